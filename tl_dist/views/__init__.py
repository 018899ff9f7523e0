"""Read-only views of a trace: tables, summaries, drawings."""
