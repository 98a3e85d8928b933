// Preloaded with `node --require` when the benchmarks start Portkey's gateway. Its start-server.js
// takes --port=N but no host: @hono/node-server then listens on every interface, and the gateway
// forwards to whatever `x-portkey-custom-host` names. The benchmarks keep every process on
// 127.0.0.1, so a listen() without a host gets 127.0.0.1. Nothing else changes.
"use strict";
const net = require("net");
const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  if (typeof args[0] === "number" && (args[1] === undefined || typeof args[1] === "function")) {
    if (args[1] === undefined && args.length > 1) args[1] = "127.0.0.1";
    else args.splice(1, 0, "127.0.0.1");
  }
  return listen.apply(this, args);
};
