"""polyshard.dp: Data parallelism: bucketed overlapped reducer, ZeRO-1/2/3, mixed precision."""
