"""Servers that run in-process: the reference server (a real transformers model behind
SGLang's ``/generate`` API and dump protocol), a fake one for tests and benchmarks, and the HTTP
front end they share (``http_app``)."""
