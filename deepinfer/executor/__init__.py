"""Running one engine over several devices: one worker process per device (a rank of the world), driven by
rank 0's engine with typed messages (``messages.py``) through one codec (``codec.py``) over a gloo control
group (``channel.py``); ``rank.py`` is what each rank runs, ``engine.py`` the data-parallel engine."""
