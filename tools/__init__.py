"""Everything that is run by hand or by tests and is not deployed: the process launcher (launch),
`pdserve up` (up), the built-in model builders and `pdserve generate` (models/), every benchmark
(bench/), the chaos suite (chaos/) and the generated docs pages (docs/). Nothing outside tools/ and
tests/ imports this package."""
