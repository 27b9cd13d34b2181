"""gRPC plumbing shared by the planner, its chat client and the devstack: outbound
channels, rich status parsing, handler wrapping."""
