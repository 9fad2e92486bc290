"""``python -m moeplace``: the same command line as the ``moeplace`` script."""

from moeplace.cli import main

main()
