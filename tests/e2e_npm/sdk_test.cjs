// The official npm `e2b` SDK, unchanged, against Cube. Run by test_npm_sdk.py with
// E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY set, CUBE_E2B_JS = the installed package dir and
// CUBE_TEMPLATE = the template. Prints one JSON line per case:
// {"case": name, "status": "pass"|"fail"|"skip", "detail": "..."}; a feature the SDK version lacks
// is a skip with the reason.
'use strict'

const e2b = require(process.env.CUBE_E2B_JS)
const { Sandbox } = e2b
const TEMPLATE = process.env.CUBE_TEMPLATE
const VERSION = require(process.env.CUBE_E2B_JS + '/package.json').version

class Skip extends Error {}

function assert(cond, msg) {
  if (!cond) throw new Error('assertion failed: ' + msg)
}

async function rejects(p, cls, what) {
  try {
    await p
  } catch (e) {
    if (cls && !(e instanceof cls)) {
      throw new Error(`${what}: expected ${cls.name}, got ${e && e.constructor && e.constructor.name}: ${e}`)
    }
    return e
  }
  throw new Error(`${what}: did not throw`)
}

async function listAll(query, limit) {
  const p = Sandbox.list({ query, limit })
  if (typeof p.nextItems !== 'function') throw new Skip(`Sandbox.list has no paginator in ${VERSION}`)
  const out = []
  let pages = 0
  while (p.hasNext) {
    out.push(...(await p.nextItems()))
    pages += 1
    if (pages > 50) throw new Error('paginator does not end')
  }
  return { items: out, pages }
}

const tag = Math.random().toString(36).slice(2, 10)
let sbx = null

const cases = [
  ['create_metadata_envs', async () => {
    sbx = await Sandbox.create(TEMPLATE, {
      timeoutMs: 120_000, metadata: { suite: 'npm', tag }, envs: { CUBE_NPM: 'yes' },
    })
    assert(/^[a-z0-9]+$/.test(sbx.sandboxId), 'sandbox id shape ' + sbx.sandboxId)
  }],
  ['commands', async () => {
    const r = await sbx.commands.run('echo hi')
    assert(r.exitCode === 0 && r.stdout === 'hi\n', JSON.stringify(r))
    const e = await sbx.commands.run('echo $CUBE_NPM')
    assert(e.stdout.trim() === 'yes', 'env var: ' + JSON.stringify(e.stdout))
  }],
  ['history', async () => {
    // The node's samples (a history, not one sample) and the log of what ran, through the
    // SDK's own API client; the failed command's exit is a warning.
    await sbx.commands.run('sh -c "exit 4"').catch(() => {})
    const api = new e2b.ApiClient(new e2b.ConnectionConfig()).api
    const path = { sandboxID: sbx.sandboxId }
    let logs = []
    for (let i = 0; i < 100; i++) {
      const r = await api.GET('/v2/sandboxes/{sandboxID}/logs', { params: { path, query: { level: 'warn' } } })
      assert(r.response.status === 200, 'logs status ' + r.response.status)
      logs = r.data.logs
      if (logs.length > 0) break
      await new Promise(res => setTimeout(res, 100))
    }
    assert(logs.length === 1 && logs[0].message === 'Process exited' && logs[0].fields.exitCode === '4',
      JSON.stringify(logs))
    const all = (await api.GET('/v2/sandboxes/{sandboxID}/logs', { params: { path } })).data.logs
    assert(all[0].message === 'Sandbox created', JSON.stringify(all[0]))
    assert(all.some(e => e.message === 'Process started' && e.fields.cmd.includes('echo hi')), 'echo hi started')
    const bad = await api.GET('/v2/sandboxes/{sandboxID}/logs', { params: { path, query: { direction: 'up' } } })
    assert(bad.response.status === 400, 'bad direction: ' + bad.response.status)
    let ms = []
    for (let i = 0; i < 100 && ms.length < 3; i++) {
      ms = await sbx.getMetrics()
      await new Promise(res => setTimeout(res, 100))
    }
    assert(ms.length >= 3, 'samples: ' + ms.length)
    const t = ms.map(m => new Date(m.timestamp).getTime())
    assert(t.every((x, i) => i === 0 || x > t[i - 1]), 'increasing times ' + JSON.stringify(t))
  }],
  ['files', async () => {
    await sbx.files.write('/tmp/npm.txt', 'hello from npm')
    const s = await sbx.files.read('/tmp/npm.txt')
    assert(s === 'hello from npm', 'read back ' + JSON.stringify(s))
  }],
  ['get_info', async () => {
    const info = typeof sbx.getInfo === 'function' ? await sbx.getInfo() : await Sandbox.getInfo(sbx.sandboxId)
    assert(info.sandboxId === sbx.sandboxId, 'id')
    assert(info.templateId === TEMPLATE, 'template ' + info.templateId)
    assert(info.metadata.tag === tag && info.metadata.suite === 'npm', 'metadata ' + JSON.stringify(info.metadata))
    const secs = (new Date(info.endAt) - new Date(info.startedAt)) / 1000
    assert(secs > 100 && secs <= 121, 'timeout window ' + secs)
  }],
  ['list_filters_paging', async () => {
    const extra = await Sandbox.create(TEMPLATE, { timeoutMs: 60_000, metadata: { suite: 'npm', tag } })
    try {
      const { items, pages } = await listAll({ metadata: { tag } }, 1)
      const ids = items.map((s) => s.sandboxId).sort()
      assert(JSON.stringify(ids) === JSON.stringify([sbx.sandboxId, extra.sandboxId].sort()), 'listed ' + ids)
      assert(pages === 2, 'pages ' + pages)
      const none = await listAll({ metadata: { tag: 'nope' + tag } })
      assert(none.items.length === 0, 'no match')
      const paused = await listAll({ metadata: { tag }, state: ['paused'] })
      assert(paused.items.length === 0, 'paused filter ' + paused.items.length)
      const running = await listAll({ metadata: { tag }, state: ['running'] })
      assert(running.items.length === 2, 'running filter ' + running.items.length)
    } finally {
      await extra.kill()
    }
  }],
  ['set_timeout', async () => {
    const before = await Sandbox.getInfo(sbx.sandboxId)
    await sbx.setTimeout(600_000)
    const after = await Sandbox.getInfo(sbx.sandboxId)
    assert((new Date(after.endAt) - new Date(before.endAt)) / 1000 > 400, 'endAt moved')
  }],
  ['pause_connect', async () => {
    const pause = typeof sbx.pause === 'function' ? () => sbx.pause()
      : typeof sbx.betaPause === 'function' ? () => sbx.betaPause() : null
    if (!pause) throw new Skip(`no pause in ${VERSION}`)
    await pause()
    const info = await Sandbox.getInfo(sbx.sandboxId)
    assert(info.state === 'paused', 'state after pause ' + info.state)
    const back = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 60_000 })
    const r = await back.commands.run('cat /tmp/npm.txt')
    assert(r.stdout === 'hello from npm', 'file survives pause ' + JSON.stringify(r.stdout))
    sbx = back
  }],
  ['auto_pause_resume', async () => {
    // 2.51 has `lifecycle`; 2.13 has `betaCreate({ autoPause })` (pause at the timeout only).
    const modern = typeof Sandbox.betaCreate !== 'function' || VERSION.split('.')[1] >= 51
    const s = modern
      ? await Sandbox.create(TEMPLATE, { timeoutMs: 3_000, lifecycle: { onTimeout: 'pause', autoResume: true } })
      : await Sandbox.betaCreate(TEMPLATE, { timeoutMs: 3_000, autoPause: true })
    try {
      await s.files.write('/tmp/lc.txt', 'kept')
      let state = ''
      for (let i = 0; i < 600 && state !== 'paused'; i++) {
        state = (await Sandbox.getInfo(s.sandboxId)).state
        if (state !== 'paused') await new Promise((r) => setTimeout(r, 100))
      }
      assert(state === 'paused', 'paused at the timeout, not killed: ' + state)
      if (modern) {
        const info = await Sandbox.getInfo(s.sandboxId)
        assert(info.lifecycle && info.lifecycle.onTimeout === 'pause' && info.lifecycle.autoResume === true,
          'lifecycle in the info: ' + JSON.stringify(info.lifecycle))
        // The next call through the edge resumes it and is served.
        const r = await s.commands.run('cat /tmp/lc.txt')
        assert(r.stdout === 'kept', 'served after the auto-resume: ' + JSON.stringify(r.stdout))
      } else {
        const back = await Sandbox.connect(s.sandboxId, { timeoutMs: 60_000 })
        const r = await back.commands.run('cat /tmp/lc.txt')
        assert(r.stdout === 'kept', 'file after connect: ' + JSON.stringify(r.stdout))
      }
      assert((await Sandbox.getInfo(s.sandboxId)).state === 'running', 'running again')
    } finally {
      await Sandbox.kill(s.sandboxId).catch(() => {})
    }
  }],
  ['refused_network_policy', async () => {
    if (VERSION.split('.')[1] < 51) {
      // 2.13 has no network option; its create body carries an unknown field the same way.
      const r = await fetch(process.env.E2B_API_URL + '/sandboxes', {
        method: 'POST', headers: { 'X-API-KEY': process.env.E2B_API_KEY, 'Content-Type': 'application/json' },
        body: JSON.stringify({ templateID: TEMPLATE, network: { egressProxy: { address: 'p:1080' } } }),
      })
      const body = await r.json()
      assert(r.status === 400 && body.message.includes('network.egressProxy'), JSON.stringify(body))
      return
    }
    // Domain names are E2B's in allowOut only: one in denyOut is refused by name.
    const e = await rejects(Sandbox.create(TEMPLATE, { network: { denyOut: ['example.com'] } }), null, 'denyOut domain')
    assert(String(e).includes('denyOut entry') && String(e).includes('allowOut only'), 'named in the error: ' + e)
    // Names and wildcards in allowOut are taken and reported as normalised (2.51 has no
    // dnsServers; tests/e2e/test_egress.py checks the egress proxy enforcing names).
    const named = await Sandbox.create(TEMPLATE, { network: { allowOut: ['Svc.Cube.Test.', '*.wild.cube.test'], denyOut: ['0.0.0.0/0'] } })
    try {
      const info = await fetch(process.env.E2B_API_URL + '/sandboxes/' + named.sandboxId, { headers: { 'X-API-KEY': process.env.E2B_API_KEY } }).then(r => r.json())
      assert(JSON.stringify(info.network.allowOut) === '["*.wild.cube.test","svc.cube.test"]', JSON.stringify(info.network))
      assert(info.network.dnsServers === undefined, JSON.stringify(info.network))
    } finally {
      await named.kill()
    }
    // An address deny is enforced, and the detail reports it.
    const s = await Sandbox.create(TEMPLATE, { network: { denyOut: ['198.51.100.9'] } })
    try {
      const info = await fetch(process.env.E2B_API_URL + '/sandboxes/' + s.sandboxId, { headers: { 'X-API-KEY': process.env.E2B_API_KEY } }).then(r => r.json())
      assert(JSON.stringify(info.network.denyOut) === '["198.51.100.9/32"]', JSON.stringify(info.network))
      await s.updateNetwork({})
      const after = await fetch(process.env.E2B_API_URL + '/sandboxes/' + s.sandboxId, { headers: { 'X-API-KEY': process.env.E2B_API_KEY } }).then(r => r.json())
      assert(after.network.denyOut === undefined, JSON.stringify(after.network))
    } finally {
      await s.kill()
    }
  }],
  ['kill', async () => {
    assert((await sbx.kill()) !== false, 'kill')
    assert((await Sandbox.kill(sbx.sandboxId)) === false, 'second kill is false')
    assert(!(await sbx.isRunning()), 'not running after kill')
  }],
  ['not_found_404', async () => {
    await rejects(Sandbox.getInfo('inotthere00000000000'), e2b.NotFoundError, 'getInfo unknown')
    assert((await Sandbox.kill('inotthere00000000000')) === false, 'kill unknown')
    await rejects(Sandbox.setTimeout('inotthere00000000000', 30_000), e2b.NotFoundError, 'setTimeout unknown')
  }],
  ['wrong_key_401', async () => {
    const apiKey = 'e2b_' + '0'.repeat(40)
    await rejects(Sandbox.create(TEMPLATE, { apiKey }), e2b.AuthenticationError, 'create')
    await rejects(Sandbox.list({ apiKey }).nextItems(), e2b.AuthenticationError, 'list')
  }],
]

async function main() {
  let failed = false
  for (const [name, fn] of cases) {
    const needsSandbox = !['create_metadata_envs', 'not_found_404', 'wrong_key_401'].includes(name)
    if (needsSandbox && !sbx) {
      console.log(JSON.stringify({ case: name, status: 'fail', detail: 'no sandbox (create failed)' }))
      failed = true
      continue
    }
    try {
      await fn()
      console.log(JSON.stringify({ case: name, status: 'pass', detail: '' }))
    } catch (e) {
      const skip = e instanceof Skip
      failed = failed || !skip
      console.log(JSON.stringify({ case: name, status: skip ? 'skip' : 'fail', detail: String(e && e.stack || e) }))
    }
  }
  if (sbx) await sbx.kill().catch(() => {})
  process.exit(failed ? 1 : 0)
}

main().catch((e) => {
  console.log(JSON.stringify({ case: 'main', status: 'fail', detail: String(e && e.stack || e) }))
  process.exit(1)
})
