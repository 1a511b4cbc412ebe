"""The offline pipeline over shards (encode, aggregate, build, search, evaluate); ``runner=``
places the same tasks in the same order, bit for bit on the CPU. README: "Beyond one machine"."""

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
