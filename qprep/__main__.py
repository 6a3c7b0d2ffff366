from qprep.cli import entry

entry()
