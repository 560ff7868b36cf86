# The fleet harness (included by the Makefile): many Lambda environments, faults injected.
#
#   make fleet                              8 processes, 50 users, 60 s, every fault
#   make fleet FLEET_ARGS="--quick"         4 processes, 10 users, 20 s
#   make fleet FLEET_ARGS="--cluster"       on a 3-master Redis Cluster with replicas
#
# After the harness, the stateful property tests (tests/integration/test_*_properties.py)
# run under the `long` Hypothesis profile: random seeds and many more examples than the
# fixed `ci` profile of `make test`. `make properties` runs only them.

FLEET_ARGS ?=
PROPERTY_TESTS = $(wildcard tests/integration/test_*_properties.py)

.PHONY: fleet properties
fleet: $(STAMP) redis-server ## Run the fleet harness (FLEET_ARGS="--quick", "--cluster"), check its invariants, then the long property tests.
	$(PY) bench/fleet.py $(FLEET_ARGS)
	ATTO_PROPERTY_PROFILE=long $(PY) -m pytest -q $(PROPERTY_TESTS)

properties: $(STAMP) redis-server ## Run the stateful property tests under the long Hypothesis profile.
	ATTO_PROPERTY_PROFILE=long $(PY) -m pytest -q $(PROPERTY_TESTS)
