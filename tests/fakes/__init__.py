"""Test seams shipped with the package: in-thread servers and fake engines that replay the
real engines' wire formats (for unit tests and the overhead benchmark, never for claims
about cache behaviour, which are tested against the real llama-server)."""
