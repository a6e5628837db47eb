import signal
import sys

from .core import stop

# SIGTERM ends the command in its one line from the first line here, not only once labkit.cli
# is imported (0.2 s cold): a warm process's fork of this program (labkit.cli._run_warm) is
# passed its client's SIGTERM as soon as it exists, and SIGTERM's default ended it silently
signal.signal(signal.SIGTERM, stop.on_sigterm)
try:
    from .cli import main

    code = main()
except KeyboardInterrupt:  # before main() took over
    code = stop.interrupted(stop.command_of(sys.argv[1:]))
sys.exit(code)
