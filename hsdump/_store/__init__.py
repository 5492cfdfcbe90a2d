"""The store: a Zarr v3 group of parts, one per writer, each a sharded array of token rows.

``store`` is the public `HiddenStateStore` (open, write, read, verify), ``options`` its
`StoreOptions`; ``intake`` checks a sample's tensors before it is written; ``part``
appends samples to one part and commits them; ``shardbuf`` and ``shardio`` place rows into shard
buffers and write and read whole shards; ``codecs``, ``stats``, ``integrity`` and ``provenance``
hold the compression, the per-layer statistics, the checksums and what produced a sample;
``roots`` and ``objstore`` open roots on local disks and on S3; ``locks`` and ``lease`` hold a
writer's part;
``reader`` reads samples back; ``zarr_adapter`` holds every use of zarr beyond its documented API.
"""
