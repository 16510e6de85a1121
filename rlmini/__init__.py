"""The plumbing under common.py, one concern per module: dist (ranks, collectives, FSDP2), models (loading,
the tiny model, LoRA), packing (batch layouts, packed attention), logprobs (token log-probs), engine (vLLM
and HF rollouts, the weight push), tools (tool calls, multi-turn rollouts), sandbox (the python tool's
confinement), data (prompts, groups, scores), faults (guards and one-line errors), checkpoint (run folder,
save and restore), runlog (metrics.jsonl, wandb). None imports common."""
