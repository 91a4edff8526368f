"""memplan's command line: a thin typer app over the memplan library."""
