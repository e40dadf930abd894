"""Everything that is run by hand or by tests and is not deployed: the process launcher (launch),
`pdserve up` (up), the built-in model builders and `pdserve generate` (models/), every benchmark
(bench/), the chaos suite (chaos/), the generated docs pages (docs/) and the transfer peer harness
that tests and `bench transfer` drive (transfer_peer/). Nothing outside tools/ and tests/ imports this
package."""
