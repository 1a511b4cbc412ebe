"""pefa_gpu: PEFA, parameter-free adapters for embedding-based retrieval, on GPU and CPU.

    import pefa_gpu as pg
    xs = pg.PEFAXS(lam=0.5).fit(P, Q, Y)
    scores, ids = xs.search(queries, topk=100)
    pg.recall_at_k(ids, Y_test, ks=(10, 100))
"""

from ._version import __version__
from .aggregate import normalize_rows, pifa
from .datasets import BeirDataset, Pairs, load_beir, load_pairs
from .encode import encode
from .errors import FormatError, InputError, MissingDependencyError, PefaError
from .index import Index, make_index
from .metrics import evaluate, mrr_at_k, ndcg_at_k, recall_at_k
from .models import (ERM, NUDGE, PEFAXL, PEFAXS, ERMParams, ERMSearchParams, NUDGEParams,
                     NUDGESearchParams, XLParams, XLSearchParams, XSParams, XSSearchParams)
from .persist import load
from .query import QueryAdapter, QueryModel, VectorPRF
from .relevance import Relevance, as_relevance
from .sweep import Config, SweepResult, sweep
from .synthetic import SyntheticData, make_synthetic
from .training import mine_negatives
from .tune import TuneResult, fit_config, tune
from .xmc import XMCData, load_xmc

__all__ = [
    "ERM", "PEFAXS", "PEFAXL", "ERMParams", "XSParams", "XLParams",
    "ERMSearchParams", "XSSearchParams", "XLSearchParams",
    "NUDGE", "NUDGEParams", "NUDGESearchParams",
    "QueryAdapter", "VectorPRF", "QueryModel",
    "pifa", "normalize_rows", "Relevance", "as_relevance",
    "recall_at_k", "ndcg_at_k", "mrr_at_k", "evaluate",
    "load", "Index", "make_index",
    "BeirDataset", "load_beir", "Pairs", "load_pairs", "XMCData", "load_xmc", "encode",
    "sweep", "Config", "SweepResult", "tune", "TuneResult", "fit_config",
    "mine_negatives", "make_synthetic", "SyntheticData",
    "PefaError", "InputError", "MissingDependencyError", "FormatError",
]
