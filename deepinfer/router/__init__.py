"""``deepinfer router``: one OpenAI-compatible endpoint in front of several ``deepinfer serve`` replicas.

Each request goes to one replica, chosen by a policy (``policies.py``): ``cache_aware`` (the default: the
replica whose prefix cache most likely holds the prompt's longest prefix, unless the replicas' loads are too
far apart), ``consistent_hash`` on a session key, ``power_of_two`` or ``round_robin``. The cache-aware policy
keeps, per replica, the token-block prefixes of the prompts it routed there (``prefix_index.py``): an
approximate view of that replica's cache (it does not see evictions), trimmed to a size. Prompts are keyed by
the token ids the replica itself will see (the completions tokenizer call and the chat template are the
server's own), in blocks of the replicas' cache block size, so a match counts what a hit could reuse.

The router proxies the response as it comes (streams included); a replica that fails before its first byte
(connection refused, 5xx) is marked, and the request tries the next one; replicas are health-checked in the
background and taken out after repeated failures (``workers.py``). ``app.py`` is the HTTP side.
"""
