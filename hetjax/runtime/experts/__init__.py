"""Routed experts: a mixture of experts' blocks that fetch only the experts routed to."""
