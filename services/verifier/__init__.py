"""The verifier service: the target model's sessions (`engine`), their committed tails, the gRPC
adapter (`servicer`) and the tensor-parallel trunk. It owns verification and never drafts or
gates."""
