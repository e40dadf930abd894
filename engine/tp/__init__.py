"""Tensor parallelism: N ranks in N processes, each holding 1/N of the heads and MLP columns.

`shard` says which slice of every weight and KV head a rank owns (and refuses layouts that do not
split), `group` wraps the torch.distributed collectives, `ranks` starts and watches the follower
processes, `runner` keeps them in step with rank 0's scheduler, `follower` is a follower's main.
`expert_parallel` sends MoE tokens to the ranks owning their experts and back (--ep-size), and
`a2a_backend` says which all-to-all library runs it (--moe-a2a-backend).
"""
