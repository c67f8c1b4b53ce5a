"""The stop signals, without torch: which signals stop a command cleanly, and handlers that turn
them into exceptions.

The ``largebatch`` command takes them over before it imports a subcommand (torch alone takes ~3 s
to import), so a signal in a command's first seconds ends it with one line, not silently (SIGTERM,
SIGHUP) or in a KeyboardInterrupt traceback (Ctrl-C). The training loop's own handling
(``largebatch.train.stopping.StopRequest``) replaces these while a run trains, and gives them back.
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, *(getattr(signal, name, None) for name in
                                                            ("SIGHUP", "SIGUSR1", "SIGUSR2"))) if s is not None)
"""The signals that stop a run (or an experiment) cleanly; SIGHUP, SIGUSR1 and SIGUSR2 where the
platform has them."""
REPEAT_WINDOW_S = 2.0
"""A repeat of the same signal within this many seconds counts as the first (train.stopping)."""


def take_signals(handler, signals=SIGNALS) -> dict[int, object]:
    """Install ``handler`` for each of ``signals`` that this process does not ignore, and return the
    handlers it replaced (restore them with ``signal.signal``). An ignored signal stays ignored:
    ``nohup`` (SIGHUP) and a non-interactive shell's background job (SIGINT) ask that the process
    outlive the terminal. Call from the main thread."""
    previous = {}
    for sig in signals:
        if signal.getsignal(sig) == signal.SIG_IGN:
            continue
        previous[sig] = signal.signal(sig, handler)
    return previous


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number."""
    return 128 + signum


class SignalledOutside(KeyboardInterrupt):
    """A stop signal outside the training loop (setup: the data cache, a tokenizer's training, the
    model's build; or after the run): raised where the main thread is, so cleanups (a data cache's
    staging directory) run and the command can say what is intact. Python's SIGINT is already a
    KeyboardInterrupt; the other ``SIGNALS`` ended the process at once, saying nothing."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def raise_on_signals():
    """While it is active (and no ``StopRequest`` holds them), each of ``SIGNALS`` that this process
    does not ignore raises ``SignalledOutside`` (SIGINT: KeyboardInterrupt, as Python's own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SignalledOutside(signum) if signum != signal.SIGINT else KeyboardInterrupt()

    previous = take_signals(handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
