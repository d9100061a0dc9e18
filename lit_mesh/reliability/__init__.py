"""What keeps a long run alive and honest when ranks fail: a hung collective named (`hangs`), faults injected on
purpose (`faults`), pre-emption by the scheduler (`preemption`), restarts under torchrun (`elastic`), resuming on
another world size (`replan`), and every rank stopping together on a non-finite loss (`nonfinite`).

Nothing is imported here: each module is imported by its own name (the public ones also as `lit_mesh.X`)."""
