"""`python -m actrace.cli`: the command, as the installed `actrace` runs it."""
import sys

from . import main

sys.exit(main())
