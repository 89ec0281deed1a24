"""Developer tools (checkpoint writers and the like); run them with ``python -m deepinfer.tools.<name>``."""
