"""Running an extraction over a dataset: in one process, in many, or on a Ray cluster.

``common`` holds what the runners share (`RunOptions`, the summary, the sink protocol, planning);
``inputs`` reads the JSONL samples (and the servers file); ``pipeline`` streams samples through
one client into one store part with progress and a summary; ``parallel`` and ``worker`` (with
``posting``) spread them over worker processes (one part each); ``ray_driver``, ``ray_actor`` and
``ray_cluster`` do the same across the nodes of a Ray cluster; ``signals`` turns SIGTERM into a
clean stop.
"""
