"""The test suite: unit/ (components, HF parity), e2e/ (engine, CLI, server), gpu/ (kernels), oracle/ (HF)."""
