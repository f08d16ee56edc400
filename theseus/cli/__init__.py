"""The ``theseus`` command line; the app is :data:`theseus.cli.app.app`."""
