"""``python -m theseus``: the ``theseus`` command."""

from theseus.cli.app import app

app()
