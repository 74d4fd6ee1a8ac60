"""`peer dashboard`: a live web page of the swarm, its state as JSON, and the pieces behind them.

- `view`: the plain core (refreshes in, page state out: peers, experts grid, runs with loss history, timeline);
- `watcher`: the client-mode peer that feeds it every few seconds and retries while the swarm is unreachable;
- `training`: the small DHT record each trainer publishes its loss in;
- `server` / `http`: the Starlette app and Hypercorn's trio worker that serves it (and `peer.metrics`);
- `static/`: the page (plain HTML, CSS and JS; plots are drawn by that JS in SVG).
"""
