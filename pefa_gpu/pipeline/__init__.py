"""The offline pipeline as functions over shards: encode, aggregate, build, search, evaluate.

    from pefa_gpu import pipeline as pp
    pp.encode(corpus_texts, "work/docs")                  # or pp.write_rows(P, "work/docs")
    pp.encode(train_texts, "work/queries")
    pp.write_relevance(Y, "work/pairs", rows=100_000)     # Y: (m x n), split by query ranges
    pp.aggregate("work/queries", "work/pairs", "work/docs", "work/xs", lam=0.5)
    pp.build("xs", "work/xs-index", docs="work/docs", embeddings="work/xs")
    scores, ids = pp.search("work/xs-index", test_queries, topk=100)
    pg.evaluate(ids, Y_test)

Every stage reads shards from folders and writes its output as shards into a folder of its
own. The functions here run in one process; ``runner=`` (:class:`LocalRunner` by default, or
:class:`pefa_gpu.distributed.RayRunner`) decides where each shard task runs and moves the
results, and nothing else. The shard tasks are the same functions either way, called on the
same shards in the same order of reduction, so a cluster run gives the answers of a
one-process run by construction (bit for bit on the CPU).

A stage folder holds ``stage.json`` (written last: the stage's commit point, a
:class:`Stage` listing its shards' row ranges and manifest checksums) and one shard per
folder, a :func:`~pefa_gpu.storage.writing_save` save: a worker killed while writing leaves
no partial shard visible. Reading a stage checks every shard against ``stage.json``, so a
stage half rewritten by an interrupted rerun is refused instead of mixed.

Modules: ``shards`` (shard and stage files, row stages, encode), ``runner``,
``aggregation``, ``indexing`` (build), ``serving`` (search, evaluate). What each stage writes:
the README's "Beyond one machine (Ray)".
"""

from .aggregation import Part, aggregate, reduce_sums, split_queries
from .indexing import METHODS, build, build_rows_shard, build_xl_shard
from .runner import Fanout, LocalRunner
from .serving import (DEFAULT_BATCH, ShardServer, evaluate_configs, search, search_batch,
                      server_groups)
from .shards import (DEFAULT_ROWS, Entry, Rows, Shard, Stage, encode, encode_fingerprint,
                     encode_shard, read_rows, read_shard, read_stage, split, write_relevance,
                     write_rows, write_shard, write_stage)

__all__ = ["DEFAULT_BATCH", "DEFAULT_ROWS", "METHODS", "Entry", "Fanout", "LocalRunner", "Part",
           "Rows", "Shard", "ShardServer", "Stage", "aggregate", "build", "build_rows_shard",
           "build_xl_shard", "encode", "encode_fingerprint", "encode_shard", "evaluate_configs",
           "read_rows", "read_shard", "read_stage", "reduce_sums", "search", "search_batch",
           "server_groups", "split", "split_queries", "write_relevance", "write_rows",
           "write_shard", "write_stage"]
