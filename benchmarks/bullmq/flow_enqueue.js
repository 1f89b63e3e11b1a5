// BullMQ's FlowProducer, the peer of flow(...).apply_async() in benchmarks/bench.py: enqueue
// K flows of N children (no worker consumes them) on the same redis-server, and report the
// time the adds took. The Redis connection is made, and the scripts loaded, before the clock
// starts, as the Python side's client and scripts are warm.
//
//   node flow_enqueue.js --url redis://127.0.0.1:PORT/3 --flows K --children N
//
// Prints one JSON line: {"children", "seconds", "commands"?}. The queue is obliterated
// afterwards, so what it held does not weigh on the next round.
'use strict';
const { FlowProducer, Queue } = require('bullmq');

function arg(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? process.argv[i + 1] : fallback;
}

function connectionOf(url) {
  const u = new URL(url);
  return {
    host: u.hostname,
    port: Number(u.port || 6379),
    db: Number((u.pathname || '/0').slice(1) || 0),
    maxRetriesPerRequest: null,
  };
}

function tree(queueName, flowIndex, children) {
  return {
    name: 'sum',
    queueName,
    data: { flow: flowIndex },
    children: Array.from({ length: children }, (_, i) => ({
      name: 'add',
      queueName,
      data: { args: [i, i] },
    })),
  };
}

async function main() {
  const connection = connectionOf(arg('url', 'redis://127.0.0.1:6379/3'));
  const flows = Number(arg('flows', '1'));
  const children = Number(arg('children', '10'));
  const queueName = arg('queue', 'bench_bullmq');
  const producer = new FlowProducer({ connection });
  const queue = new Queue(queueName, { connection });
  // Warm up: connection, script load, one small flow (removed below).
  await producer.add(tree(queueName, -1, 2));
  await queue.obliterate({ force: true });
  const trees = Array.from({ length: flows }, (_, k) => tree(queueName, k, children));
  const t0 = process.hrtime.bigint();
  for (const t of trees) {
    await producer.add(t);
  }
  const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
  process.stdout.write(`${JSON.stringify({ children: flows * children, seconds })}\n`);
  await queue.obliterate({ force: true });
  await producer.close();
  await queue.close();
}

main().catch((err) => {
  process.stderr.write(`${err && err.stack ? err.stack : err}\n`);
  process.exit(1);
});
