// The official npm `@e2b/code-interpreter` SDK, unchanged, against Cube's code-interpreter
// template. Run by test_code_interpreter_npm.py with E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY
// set and CUBE_CI_JS = the installed package dir. Prints one JSON line per case:
// {"case": name, "status": "pass"|"fail", "detail": "..."}.
'use strict'

const { Sandbox } = require(process.env.CUBE_CI_JS)

function assert(cond, msg) {
  if (!cond) throw new Error('assertion failed: ' + msg)
}

const cases = {
  async one_plus_one(sbx) {
    const ex = await sbx.runCode('1+1')
    assert(ex.error === undefined || ex.error === null, `error ${JSON.stringify(ex.error)}`)
    assert(ex.text === '2', `text ${ex.text}`)
    assert(ex.results.length === 1 && ex.results[0].isMainResult, JSON.stringify(ex.results))
  },
  async state_and_env(sbx) {
    await sbx.runCode('x = 40')
    const ex = await sbx.runCode('x + 2')
    assert(ex.text === '42', `text ${ex.text}`)
    const env = await sbx.runCode('import os; os.environ["SBX_VAR"] + "/" + os.environ["CALL_VAR"]',
      { envs: { CALL_VAR: 'per-call' } })
    assert(env.text === 'from-create/per-call', `env ${env.text}`)
  },
  async streaming_callbacks(sbx) {
    const out = []
    const err = []
    const ex = await sbx.runCode('import sys\nprint("to out")\nprint("to err", file=sys.stderr)', {
      onStdout: (m) => out.push(m.line),
      onStderr: (m) => err.push(m.line),
    })
    assert(out.join('').includes('to out'), `stdout ${JSON.stringify(out)}`)
    assert(err.join('').includes('to err'), `stderr ${JSON.stringify(err)}`)
    assert(ex.logs.stdout.join('').includes('to out'), JSON.stringify(ex.logs))
  },
  async errors(sbx) {
    const ex = await sbx.runCode('1/0')
    assert(ex.error && ex.error.name === 'ZeroDivisionError', JSON.stringify(ex.error))
    assert(ex.error.traceback.includes('ZeroDivisionError'), ex.error.traceback)
  },
  async chart_png(sbx) {
    const ex = await sbx.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()')
    const png = ex.results.find((r) => r.png)
    assert(png, `no png in ${JSON.stringify(ex.results.map((r) => Object.keys(r)))}`)
    assert(Buffer.from(png.png, 'base64').subarray(1, 4).toString() === 'PNG', 'not a PNG')
  },
  async contexts(sbx) {
    const ctx = await sbx.createCodeContext({ language: 'python' })
    await sbx.runCode('y = "in ctx"', { context: ctx })
    const other = await sbx.runCode('"y" in globals()')
    assert(other.text === 'False', `default context sees y: ${other.text}`)
    const same = await sbx.runCode('y', { context: ctx })
    assert(same.text === 'in ctx', `ctx lost y: ${same.text}`)
    const bash = await sbx.runCode('echo $((6 * 7))', { language: 'bash' })
    assert(bash.logs.stdout.join('').trim() === '42', JSON.stringify(bash.logs))
  },
  async timeout(sbx) {
    let threw = null
    try {
      await sbx.runCode('import time\ntime.sleep(30)', { timeoutMs: 1000 })
    } catch (e) {
      threw = e
    }
    assert(threw, 'a 30 s cell with a 1 s timeout returned')
    // The context is usable again afterwards.
    const ex = await sbx.runCode('2+2')
    assert(ex.text === '4', `after timeout: ${ex.text}`)
  },
}

async function main() {
  const sbx = await Sandbox.create({ timeoutMs: 300_000, envs: { SBX_VAR: 'from-create' } })
  try {
    for (const [name, fn] of Object.entries(cases)) {
      try {
        await fn(sbx)
        console.log(JSON.stringify({ case: name, status: 'pass' }))
      } catch (e) {
        console.log(JSON.stringify({ case: name, status: 'fail', detail: String(e && e.stack || e) }))
      }
    }
  } finally {
    await sbx.kill()
  }
}

main().catch((e) => {
  console.log(JSON.stringify({ case: 'main', status: 'fail', detail: String(e && e.stack || e) }))
  process.exit(1)
})
