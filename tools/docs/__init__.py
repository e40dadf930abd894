"""Pages of docs/ that are generated from the code rather than written by hand."""
