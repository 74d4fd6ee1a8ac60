"""Decentralized mixture-of-experts: expert servers, remote experts, fault-tolerant MoE layers."""
