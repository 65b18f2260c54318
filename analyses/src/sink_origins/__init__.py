"""Where attention sinks come from (`interp sinks`): per head, the sink mass on the first token, the first
delimiter and other keys (and gpt-oss's learned sink share); per layer, the residual stream's massive
activations; and interventions that ask which component makes the first token a sink (`measure`,
`interventions`, `study`).

A room of its own beside the flat `analyses/src/sinks.py` (the atlas's sink detector, imported by the atlas and
the registry under that name): a package `analyses/src/sinks/` would shadow that module, so this one is named for
what it asks, the sinks' origins."""
