from raysys.cli import entry

entry()
