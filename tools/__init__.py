"""Everything that is run by hand or by tests and is not deployed (docs generation: docs/).
Nothing outside tools/ and tests/ imports this package."""
