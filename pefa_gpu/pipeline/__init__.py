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
:class:`Stage` listing its shards with their row ranges and each shard's manifest checksum)
and one folder per shard. A shard is a save in :mod:`pefa_gpu.storage`'s layout
(``pefa_shard.json`` + a ``pefa-data-<hex>`` folder, written by
:func:`~pefa_gpu.storage.writing_save`): a worker killed while writing leaves no partial shard
visible, and the next write removes its leftovers. Reading a stage checks every shard against
``stage.json``, so a stage half rewritten by an interrupted rerun is refused instead of mixed.

What each stage writes (``shards``: shards, stages, rows and encode; ``aggregation``;
``indexing``: build; ``serving``: search and evaluate; ``runner`` runs their tasks):

- ``write_rows`` / ``encode``: ``shard-NNNNN`` with ``embeddings.npy`` ((rows, d) float32;
  L2-normalised when encoded). ``encode`` skips shards already written for the same texts
  and model, and encodes through :func:`pefa_gpu.encode` with its cache keys.
- ``write_relevance``: ``shard-NNNNN`` with ``relevance.npz``, the rows of Y of one query
  range (all n columns). Its shards are the aggregation's map tasks.
- ``aggregate``: ``doc-NNNNN`` per document range with ``sums.npy`` (Yᵀ Q, + P with
  augment_docs) and, given ``lam``, ``embeddings.npy`` (the PEFA-XS E).
- ``build``: ``doc-NNNNN`` per document range with a model save (``model/``: ERM over P or
  over E, or a PEFA-XL shard), ``query-NNNNN`` per query range for PEFA-XL (an ERM over those
  training queries: the shard of XL's query index), optionally ``hnsw.faiss`` per document
  shard (:meth:`export_hnsw <pefa_gpu.models.ERM.export_hnsw>`, for CPU serving).
- ``search``: returns the merged top-k; :func:`evaluate_configs` turns it into metrics.
"""

from .aggregation import Part, aggregate, reduce_sums, split_queries
from .indexing import METHODS, build, build_rows_shard, build_xl_shard
from .runner import Fanout, LocalRunner
from .serving import (DEFAULT_BATCH, ShardServer, evaluate_configs, search, search_batch,
                      server_groups)
from .shards import (DEFAULT_ROWS, Entry, Rows, Shard, Stage, encode, encode_fingerprint,
                     encode_shard, read_rows, read_shard, read_stage, split, write_relevance,
                     write_rows, write_shard, write_stage)
