// BullMQ's flow end to end, the peer of flow(...) in benchmarks/peers/: K flows of N `add`
// children under a `sum` parent (one FlowProducer.add per flow), run by one Worker of
// concurrency 2 in this process; timed from the first add to the completion of the last
// parent, whose processor reads its children's values with job.getChildrenValues().
//
//   node flow_e2e.js --url redis://127.0.0.1:PORT/6
//
// Speaks benchmarks/peers/protocol.py's lines: {"ready": true}, then `run K N` ->
// {"seconds": S}, `quit`.
'use strict';
const readline = require('readline');
const { FlowProducer, Worker } = require('bullmq');

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

function tree(queueName, children) {
  return {
    name: 'sum',
    queueName,
    data: {},
    children: Array.from({ length: children }, (_, i) => ({
      name: 'add',
      queueName,
      data: { args: [i, i] },
    })),
  };
}

async function main() {
  const connection = connectionOf(arg('url', 'redis://127.0.0.1:6379/6'));
  const queueName = arg('queue', 'peers');
  const producer = new FlowProducer({ connection });
  let onParent = () => {};
  const worker = new Worker(
    queueName,
    async (job) => {
      if (job.name === 'add') return job.data.args[0] + job.data.args[1];
      const values = Object.values(await job.getChildrenValues());
      return values.reduce((a, b) => a + b, 0);
    },
    { connection, concurrency: 2 },
  );
  worker.on('completed', (job, value) => {
    if (job.name === 'sum') onParent(value);
  });
  await worker.waitUntilReady();

  async function run(flows, children) {
    const trees = Array.from({ length: flows }, () => tree(queueName, children));
    const values = [];
    const done = new Promise((resolve) => {
      onParent = (value) => {
        values.push(value);
        if (values.length === flows) resolve();
      };
    });
    const t0 = process.hrtime.bigint();
    for (const t of trees) {
      await producer.add(t);
    }
    await done;
    const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
    const want = (children * (children - 1));
    if (values.some((v) => v !== want)) throw new Error(`wrong parent values: ${values.slice(0, 5)}`);
    return seconds;
  }

  await run(2, 2); // warm up: scripts loaded, connections made
  const { version } = require("bullmq/package.json");
  process.stdout.write(`${JSON.stringify({ ready: true, version })}\n`);
  const lines = readline.createInterface({ input: process.stdin });
  for await (const line of lines) {
    const words = line.trim().split(/\s+/);
    if (!words[0] || words[0] === 'quit') break;
    try {
      const seconds = await run(Number(words[1]), Number(words[2]));
      process.stdout.write(`${JSON.stringify({ seconds })}\n`);
    } catch (err) {
      process.stdout.write(`${JSON.stringify({ error: String(err && err.stack ? err.stack : err) })}\n`);
    }
  }
  await worker.close();
  await producer.close();
  process.exit(0);
}

main().catch((err) => {
  process.stderr.write(`${err && err.stack ? err.stack : err}\n`);
  process.exit(1);
});
