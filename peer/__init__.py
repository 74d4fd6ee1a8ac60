"""swarmd's network node: foundation (wire, rpc, identity, net, bridge) and the top (daemon, client, cli)."""

__version__ = "0.1.0"
