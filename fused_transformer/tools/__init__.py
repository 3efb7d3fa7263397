"""The tools behind ``python -m fused_transformer``: nothing here is needed to use the modules.

- ``check`` (with its grid ``check_cases`` and the accuracy rule ``numerics``): every op and module on every
  backend against float64.
- ``bench`` (with ``bench_cases``, ``bench_timing``, ``bench_plots``): throughput and memory against torch.
- ``report``: the ahead-of-time resource report of every shipped Triton kernel config.
"""


class Interrupted(KeyboardInterrupt):
    """A command stopped by Ctrl-C after keeping what it had finished; ``str()`` says what was kept and where.
    ``python -m fused_transformer`` prints it on one line and exits with status 130."""
