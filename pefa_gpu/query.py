"""Query-side families; both change the query, never the documents, so they compose with any
model: ``model.search(prf(adapter(q), model), 100)`` or ``QueryModel(model, adapter, prf)``.

**QueryAdapter**: ridge regression of the targets T = Π(Y P) on the queries, W = I + (QᵀQ +
αI)⁻¹ Qᵀ(T − Q) over the queries whose target is nonzero (float64 normal equations, one
Cholesky, W float32); a query maps to Π(qW). ``alpha=None`` picks from ``ALPHAS`` the best
held-out Recall@10 of exact search over P (largest α on ties), then refits on every query.

**VectorPRF** (no labels): q' = q + β mean(p_j, j in the top-k documents of q under the model).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import persist, storage
from ._version import __version__
from .aggregate import normalize_rows, normalize_rows_, pifa
from .arrays import (ArrayLike, DeviceLike, as_embeddings, as_tensor, check_topk,
                     resolve_device)
from .errors import FormatError, InputError
from .index import make_index
from .metrics import recall_at_k
from .params import (Params, check_held_out, check_memory, check_positive, check_scale,
                     checked, is_number)
from .protocol import Model, check_model
from .relevance import RelevanceLike, as_relevance
from .splits import split_queries
from .training import check_default

if TYPE_CHECKING:
    from typing import Self  # Python >= 3.11


ALPHAS: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0, 10.0)  # QueryAdapter's α grid
GRAM_ROWS = 1 << 16  # query rows per float64 block of QᵀQ
PRF_CELLS = 1 << 22  # float32 cells of feedback rows VectorPRF gathers at a time


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdapterParams(Params):
    """alpha: the ridge term (> 0), or None: chosen on a seeded ``val_fraction`` of the queries."""

    alpha: float | None = None
    val_fraction: float = 0.2
    seed: int = 0

    def validate(self) -> None:
        if self.alpha is not None and not (is_number(self.alpha) and self.alpha > 0):
            raise InputError(f"alpha must be None or a finite number > 0, got {self.alpha!r}")
        check_held_out(self.val_fraction, self.seed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PRFParams(Params):
    """k: feedback documents per query; beta: their mean's weight (a finite number >= 0)."""

    k: int = checked(3, check_positive)
    beta: float = checked(0.5, check_scale)


def _normal_equations(q: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(QₖᵀQₖ, Qₖᵀ(Tₖ − Qₖ)) in float64 over the rows k whose target is nonzero."""
    keep = (t != 0).any(1)
    q, t = q[keep], t[keep]
    gram, cross = torch.zeros(2, q.shape[1], q.shape[1], dtype=torch.float64, device=q.device)
    for s in range(0, q.shape[0], GRAM_ROWS):
        qb, tb = q[s:s + GRAM_ROWS].double(), t[s:s + GRAM_ROWS].double()
        gram += qb.T @ qb
        cross += qb.T @ (tb - qb)
    return gram, cross


def _solve(gram: torch.Tensor, cross: torch.Tensor, alpha: float) -> torch.Tensor:
    """W = I + (gram + αI)⁻¹ cross: (d, d) float64 (Cholesky of the SPD matrix)."""
    eye = torch.eye(gram.shape[0], dtype=torch.float64, device=gram.device)
    chol, failed = torch.linalg.cholesky_ex(gram + alpha * eye)
    if int(failed):
        raise InputError(f"alpha={alpha!r} is too small: QᵀQ + αI of the training queries is "
                         f"not positive definite in float64 (they span fewer than "
                         f"{gram.shape[0]} directions); use a larger alpha")
    return eye + torch.cholesky_solve(cross, chol)


class _Saved:
    """The query-side parts load as the models do."""

    @classmethod
    def load(cls, directory: str | Path, device: DeviceLike = None) -> Self:
        """A save written by ``save`` (else FormatError)."""
        return persist.load_model(directory, device=device, expect=cls)

    def _header(self) -> dict[str, Any]:
        return {"library_version": __version__, "class": type(self).__name__,
                "params": self.params.to_dict() if hasattr(self, "params") else {}}


class QueryAdapter(_Saved):
    """The linear map Π(qW) (module docstring); after ``fit``: ``W`` (d, d) float32,
    ``fitted_alpha``, ``validation`` {alpha: held-out Recall@10}."""

    Params = AdapterParams

    def __init__(self, alpha: float | None = None, *, val_fraction: float = 0.2, seed: int = 0,
                 device: DeviceLike = None):
        self.params = AdapterParams(alpha=alpha, val_fraction=val_fraction, seed=seed)
        self.device = resolve_device(device)
        self.W: torch.Tensor | None = None
        self.fitted_alpha: float | None = None
        self.validation: dict[float, float] = {}

    def __repr__(self) -> str:
        return (f"QueryAdapter(alpha={self.params.alpha!r}, fitted_alpha={self.fitted_alpha!r},"
                f" device='{self.device}')")

    def fit(self, Q: ArrayLike, Y: RelevanceLike, P: ArrayLike) -> "QueryAdapter":
        """Q: (m, d) training queries, Y: (m x n) relevance, P: (n, d) documents."""
        p = as_embeddings(P, self.device, "P", check_norm=False).detach()
        q = as_embeddings(Q, self.device, "Q", dim=p.shape[1], check_norm=False,
                          dim_from="P's").detach()
        rel = as_relevance(Y, shape=(q.shape[0], p.shape[0]))
        d = p.shape[1]
        if p.device.type == "cpu":  # 2 rows of d = 30000 asked 14.4 GB: torch's RuntimeError
            check_memory(7 * 8 * d * d, f"QueryAdapter: the ({d}, {d}) float64 normal "
                                        f"equations and their solve need about", "memory")
        t = pifa(rel.transpose(), p, normalize=False, device=p.device)  # Y P: (m, d)
        bad = (~torch.isfinite(t).all(1)).nonzero().squeeze(1)
        if bad.numel():  # Π of inf is NaN: a NaN W, every adapted query NaN
            raise InputError(f"Y P, the targets of training queries {bad[:5].tolist()}, "
                             f"overflow float32 (±3.4e38): scale Y's weights or P down")
        t = normalize_rows_(t)  # T = Π(Y P)
        self.validation = {}
        alpha = self.params.alpha or self._choose_alpha(p, q, t, rel)  # a set alpha is > 0
        w = _solve(*_normal_equations(q, t), alpha).float()
        if not bool(torch.isfinite(w).all()):  # tiny queries over a tiny alpha: save/load refuse
            raise InputError(f"alpha={alpha!r} is too small for these training queries: W "
                             f"overflows float32 (±3.4e38); use a larger alpha")
        self.W, self.fitted_alpha = w, float(alpha)
        return self

    def _choose_alpha(self, p: torch.Tensor, q: torch.Tensor, t: torch.Tensor, rel: RelevanceLike
                      ) -> float:
        if q.shape[0] < 2:
            raise InputError(f"QueryAdapter chooses alpha on held-out training queries and needs"
                             f" at least 2 of them, got {q.shape[0]}: set alpha")
        fit_rows, val_rows = split_queries(q.shape[0], self.params.val_fraction,
                                           self.params.seed)
        fit_t, val_t = (as_tensor(r, device=self.device) for r in (fit_rows, val_rows))
        gram, cross = _normal_equations(q[fit_t], t[fit_t])
        y_val = rel.rows(val_rows)
        if not (y_val.csr.data > 0).any():  # negative weights only: every recall was 0
            raise InputError(f"QueryAdapter: none of the {len(val_rows)} held-out training "
                             f"queries has a relevant document, so alpha cannot be chosen: set "
                             f"alpha or change seed / val_fraction")
        index = make_index("exact", self.device).build(p)
        for alpha in ALPHAS:
            w = _solve(gram, cross, alpha).float()
            _, ids = index.search(q[val_t] @ w, 10)
            self.validation[alpha] = float(recall_at_k(ids, y_val, ks=(10,))[10])
        return max(reversed(ALPHAS), key=lambda a: self.validation[a])  # largest of the best

    def __call__(self, queries: ArrayLike, check: bool | None = None) -> torch.Tensor:
        """(B, d) queries -> Π(q W): (B, d) float32 on the adapter's device. ``check`` tests
        the queries for NaN / inf (default: unless they are a CUDA tensor)."""
        if self.W is None:
            raise InputError("QueryAdapter is not fitted: call fit() first")
        q = as_embeddings(queries, self.device, "queries", dim=self.W.shape[0],
                          check_norm=False, check_finite=check_default(queries, check)).detach()
        return normalize_rows(q @ self.W)

    def save(self, directory: str | Path) -> None:
        """Write W and the settings to ``directory`` (a checksummed save for pefa_gpu.load)."""
        if self.W is None:
            raise InputError("QueryAdapter is not fitted: call fit() first")
        with storage.writing_save(directory) as w:
            meta = storage.save_tensor(w.data / "W", self.W)
            w.commit({**self._header(), "fitted_alpha": self.fitted_alpha,
                      "validation": [[a, v] for a, v in self.validation.items()], "W": meta})

    @classmethod
    def _from_save(cls, save: storage.SaveDir, device: DeviceLike, mmap: bool) -> "QueryAdapter":
        m = save.manifest
        out = cls(device=device, **(m.get("params") or {}))  # bad params: persist's FormatError
        meta = m.get("W") if isinstance(m.get("W"), dict) else {}
        w = storage.load_tensor(save.file(meta.get("file")), out.device, meta=meta)
        a = m.get("fitted_alpha")
        if w.dtype != torch.float32 or w.ndim != 2 or w.shape[0] != w.shape[1] or not w.numel() \
                or not (is_number(a) and a > 0) or not bool(torch.isfinite(w).all()):
            raise FormatError(f"{save.where}: W must be a finite float32 (d, d) matrix (d > 0) and "
                              f"fitted_alpha a number > 0, got {w.dtype} {tuple(w.shape)}, "
                              f"{a!r}")
        pairs = m.get("validation") or []
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(map(is_number, p)) for p in pairs):
            raise FormatError(f"{save.where}: validation must be a list of [alpha, recall] "
                              f"number pairs, got {pairs!r:.200}")
        out.W, out.fitted_alpha = w, float(a)
        out.validation = {float(x): float(v) for x, v in pairs}
        return out


class VectorPRF(_Saved):
    """Vector pseudo-relevance feedback (module docstring); holds no data."""

    Params = PRFParams

    def __init__(self, k: int = 3, beta: float = 0.5):
        self.params = PRFParams(k=k, beta=beta)

    def __repr__(self) -> str:
        return f"VectorPRF(k={self.params.k}, beta={self.params.beta!r})"

    def __call__(self, queries: ArrayLike, model: Model) -> torch.Tensor:
        """(B, d) queries, a fitted model -> (B, d) float32 on the model's device."""
        check_model(model, "VectorPRF", ("as_queries", "search", "doc_embeddings"))
        q = model.as_queries(queries)
        k = check_topk(self.params.k, model.doc_embeddings.shape[0], "VectorPRF: k")  # not topk
        _, ids = model.search(q, k, check=False)
        total = torch.zeros_like(q)
        step = max(1, PRF_CELLS // max(q.numel(), 1))  # of the (B, k, d) rows, not all at once
        for j in range(0, ids.shape[1], step):
            i = ids[:, j:j + step]
            total += (model.doc_embeddings[i.clamp_min(0)].float() * (i >= 0)[:, :, None]).sum(1)
        return q + self.params.beta * (total / (ids >= 0).sum(1, keepdim=True).clamp_min(1))

    def save(self, directory: str | Path) -> None:
        """Write the settings to ``directory``; read back with :func:`pefa_gpu.load`."""
        with storage.writing_save(directory) as w:
            w.commit(self._header())

    @classmethod
    def _from_save(cls, save: storage.SaveDir, device: DeviceLike, mmap: bool) -> "VectorPRF":
        return cls(**(save.manifest.get("params") or {}))


class QueryModel(_Saved):
    """``search(q)`` = ``model.search(prf(adapter(q), model))`` (either part may be None);
    saves as one folder holding the model's save."""

    def __init__(self, model: Model, adapter: QueryAdapter | None = None,
                 prf: VectorPRF | None = None):
        for name, part, cls in (("adapter", adapter, QueryAdapter), ("prf", prf, VectorPRF)):
            if part is not None and not isinstance(part, cls):
                raise TypeError(f"QueryModel: {name} must be a {cls.__name__} or None, got "
                                f"{type(part).__name__}")
        check_model(model, "QueryModel", ("as_queries", "search", "dim"))
        if isinstance(model, _Saved):  # a QueryModel: saved, it would not load (nor take a prf)
            raise TypeError("QueryModel: model must be a pefa_gpu model (ERM, PEFAXS, ...), got a "
                            "QueryModel: give its model, adapter and prf to one QueryModel")
        if adapter is not None and adapter.W is None:
            raise InputError("QueryModel: the adapter is not fitted")
        if adapter is not None and adapter.W.shape[0] != model.dim:
            raise InputError(f"QueryModel: the adapter maps dimension {adapter.W.shape[0]}, the "
                             f"model holds dimension {model.dim}")
        if adapter is not None and adapter.device != model.device:  # a copy: inputs are read
            adapter = copy.copy(adapter)
            adapter.W, adapter.device = adapter.W.to(model.device), model.device
        self.model, self.adapter, self.prf = model, adapter, prf

    def __repr__(self) -> str:
        return f"QueryModel({self.model!r}, adapter={self.adapter!r}, prf={self.prf!r})"

    device = property(lambda self: self.model.device)
    n_docs = property(lambda self: self.model.n_docs)
    dim = property(lambda self: self.model.dim)

    def as_queries(self, queries: ArrayLike, check: bool | None = None,
                   name: str = "queries") -> torch.Tensor:
        """The model's :meth:`as_queries` (checked, converted); :meth:`search` adapts them."""
        return self.model.as_queries(queries, check, name)

    def queries(self, queries: ArrayLike, check: bool | None = None) -> torch.Tensor:
        """The queries as the model searches them: (B, d) float32 on its device (``check``: for
        NaN / inf, as :meth:`search`'s)."""
        q = self.model.as_queries(queries, check)
        if self.adapter is not None:
            q = self.adapter(q, check=False)
        return q if self.prf is None else self.prf(q, self.model)

    def search(self, queries: ArrayLike, topk: int = 100, check: bool | None = None, *,
               params: Params | None = None, index_params: Params | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the model's ``search``, on :meth:`queries`."""
        return self.model.search(self.queries(queries, check), topk, check=False, params=params,
                                 index_params=index_params)

    def save(self, directory: str | Path) -> None:
        """Write the model, adapter and feedback settings into ``directory`` atomically."""
        parts = {k: v for k in ("model", "adapter", "prf") if (v := getattr(self, k)) is not None}
        with storage.writing_save(directory) as w:
            for name, part in parts.items():
                part.save(w.data / name)
            w.commit({**self._header(), "parts": {k: k for k in parts}})

    @classmethod
    def _from_save(cls, save: storage.SaveDir, device: DeviceLike, mmap: bool) -> "QueryModel":
        parts = save.manifest.get("parts")
        if not isinstance(parts, dict) or "model" not in parts \
                or not set(parts) <= {"model", "adapter", "prf"}:
            raise FormatError(f"{save.where}: 'parts' must name the model and optionally the "
                              f"adapter and prf, got {parts!r}")
        want = {"model": None, "adapter": QueryAdapter, "prf": VectorPRF}
        loaded = {}
        for name, rel in parts.items():  # every file was checked against the outer manifest
            part = persist.load_model(save.folder(rel), device=device, mmap=mmap, verify=False)
            if not isinstance(part, want[name]) if want[name] else isinstance(part, _Saved):
                raise FormatError(f"{save.where}: part {name!r} holds a {type(part).__name__}")
            loaded[name] = part
        try:  # e.g. an adapter of another dimension than the model
            return cls(**loaded)
        except InputError as exc:
            raise FormatError(f"{save.where}: {exc}") from None


for _cls in (QueryAdapter, VectorPRF, QueryModel):
    persist.register_model(_cls)  # pefa_gpu.load finds them by name

