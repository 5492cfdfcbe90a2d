"""The client path of one request: send the token ids, wait for the server's dump, check it.

``client`` holds `HiddenStateClient` (the in-flight gate, the request, the probe
of the server); ``watcher`` waits for a request's ``done`` marker (inotify, polling, watchfiles);
``loading``, ``validate`` and ``dumpfiles`` turn a published dump into checked tensors (the
checks against the request; the mapped tensor files and their values); ``budget`` bounds the
bytes of dumps held in the root; ``janitor`` removes what dead clients left there.
"""
