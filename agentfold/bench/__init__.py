"""Benchmarks: decode, sessions, agent transcript, load, offload, the suite and its report.

Each `agentfold bench ...` command has its module (`decode`, `sessions`, `agent`, `suite`,
`offload`, `quality`, `load`); what they share lives apart so every record is measured and
written the same way: `machine` (the run header, machine, versions, copy bandwidth, `finish_run`),
`weights` (model records, bytes per token), `rates` (`steady_tps`, completion rows), `prompts`
(the fixed decode workloads), `mlx_baseline` (stock mlx-lm), `harness` (the `agentfold serve`
process, `BenchError`, `TokenClock`) and `server` (the streaming HTTP client).
"""
