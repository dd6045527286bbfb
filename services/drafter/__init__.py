"""The drafter service: the drafter interface, the DSpark engine, the oracle drafters and the gRPC
adapter. It owns drafting and the draft rings and never verifies or gates."""
