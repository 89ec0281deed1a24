"""Client-side benchmarks for OpenAI-compatible servers (``deepinfer bench serve``).

    datasets.py  the prompts: random token ids, a JSONL file or a ShareGPT dump
    client.py    one streamed HTTP request, timed chunk by chunk
    metrics.py   statistics over the timed requests, the result table and JSON
    options.py   the command-line flags and their validation
    serve.py     the run: arrivals, the concurrency limit, progress, saving

Nothing here imports the HTTP client at module level except ``client.py``, so ``--help`` and the
statistics work without the ``bench`` extra installed.
"""
