"""The SGLang side of hsdump: a server plugin that dumps prefill hidden states.

Installed with the ``hsdump`` distribution, it registers `sglang_patch.plugin.register` as
an ``sglang.srt.plugins`` entry point. It is inert unless ``HSDUMP_DUMP_DIR`` is set. It shares
only the on-disk format (`hsdump._protocol`) with the client and never imports the client's
dependencies (httpx, inotify_simple, zarr). See ``docs/sglang.md``.
"""

__all__: list[str] = []
