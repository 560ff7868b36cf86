# The fleet harness (included by the Makefile): many Lambda environments, faults injected.
#
#   make fleet                              8 processes, 50 users, 60 s, every fault
#   make fleet FLEET_ARGS="--quick"         4 processes, 10 users, 20 s
#   make fleet FLEET_ARGS="--cluster"       on a 3-master Redis Cluster with replicas

FLEET_ARGS ?=

.PHONY: fleet
fleet: $(STAMP) redis-server ## Run the fleet harness (FLEET_ARGS="--quick", "--cluster") and check its invariants.
	$(PY) bench/fleet.py $(FLEET_ARGS)
