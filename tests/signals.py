"""Ctrl-C in the tests as in a terminal, also when the test run itself was started with SIGINT ignored (a shell
starts background jobs, ``cmd &`` and ``nohup cmd &``, that way, and their children inherit it: Python then installs
no KeyboardInterrupt handler)."""
import signal


def sigint_as_in_a_terminal() -> None:
    """SIGINT back to its default disposition: the ``preexec_fn`` of a child the tests send Ctrl-C to."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
