"""The serving load generator behind `infer bench serve`: prompts, one streaming request, the run,
and the statistics; rendering lives with the command."""
