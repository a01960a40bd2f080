"""The ``legorl`` command line: thin typer commands that parse options and call a stage."""
