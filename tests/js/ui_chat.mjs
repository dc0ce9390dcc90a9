// Drives the AI SDK's own chat client (the `ai` package's AbstractChat, the state machine
// under React's useChat, with its DefaultChatTransport) against a Sluice UI-message endpoint,
// and prints what the client ended with as one JSON object on stdout.
//
// Usage: node ui_chat.mjs '<json config>'
//   api             the endpoint URL (POST)
//   text            the user message
//   body            fields added to the request body (model, max_tokens, ...)
//   headers         request headers
//   stopAfterChars  call chat.stop() once the assistant's text has this many characters
//   cancelAfterChars  instead, POST <origin>/v1/streams/<id>/cancel (a cancel from outside)
//   resume          after the stop, call chat.resumeStream(), reading GET <resume.api>
//                   with <resume.headers>; "{streamId}" in either is the stream's id
//
// Output: {status, error, messages, chunks, headers, finish}: the chat's status and error
// message, its messages, every chunk the transport parsed (uiMessageChunkSchema), the
// response headers of the POST, and what onFinish was told.
import { AbstractChat, DefaultChatTransport } from "ai";

class State {
  constructor() {
    this.status = "ready";
    this.error = undefined;
    this.messages = [];
  }
  pushMessage(message) {
    this.messages = this.messages.concat(message);
  }
  popMessage() {
    this.messages = this.messages.slice(0, -1);
  }
  replaceMessage(index, message) {
    this.messages = [
      ...this.messages.slice(0, index),
      this.snapshot(message),
      ...this.messages.slice(index + 1),
    ];
  }
  snapshot(value) {
    return structuredClone(value);
  }
}

class Chat extends AbstractChat {
  constructor(init) {
    super({ ...init, state: new State() });
  }
}

const config = JSON.parse(process.argv[2]);
const chunks = [];
let postHeaders = null;
let streamId = null;

class RecordingTransport extends DefaultChatTransport {
  processResponseStream(stream) {
    return super.processResponseStream(stream).pipeThrough(
      new TransformStream({
        transform(chunk, controller) {
          chunks.push(chunk);
          controller.enqueue(chunk);
        },
      }),
    );
  }
}

const substitute = (value) => value.replaceAll("{streamId}", streamId);

async function recordingFetch(url, init) {
  const response = await fetch(url, init);
  if (init?.method === "POST") {
    postHeaders = Object.fromEntries(response.headers.entries());
    streamId = response.headers.get("x-sluice-stream-id");
  }
  return response;
}

const transport = new RecordingTransport({
  api: config.api,
  headers: config.headers ?? {},
  body: config.body ?? {},
  fetch: recordingFetch,
  prepareReconnectToStreamRequest: () => ({
    api: substitute(config.resume.api),
    headers: Object.fromEntries(
      Object.entries(config.resume.headers ?? {}).map(([k, v]) => [k, substitute(v)]),
    ),
  }),
});

let finish = null;
const chat = new Chat({
  transport,
  onFinish: ({ isAbort, isDisconnect, isError, finishReason }) => {
    finish = { isAbort, isDisconnect, isError, finishReason: finishReason ?? null };
  },
});

const assistantText = () =>
  chat.messages
    .filter((m) => m.role === "assistant")
    .flatMap((m) => m.parts)
    .filter((p) => p.type === "text")
    .map((p) => p.text)
    .join("");

let stopped = false;
const after = config.stopAfterChars ?? config.cancelAfterChars;
if (after !== undefined) {
  // Checked after every chunk the chat applies (the state's setters are its only hooks).
  const state = chat.state;
  const replace = state.replaceMessage.bind(state);
  const push = state.pushMessage.bind(state);
  const check = () => {
    if (stopped || assistantText().length < after) return;
    stopped = true;
    if (config.stopAfterChars !== undefined) {
      void chat.stop();
    } else {
      void fetch(`${new URL(config.api).origin}/v1/streams/${streamId}/cancel`, { method: "POST" });
    }
  };
  state.replaceMessage = (index, message) => {
    replace(index, message);
    check();
  };
  state.pushMessage = (message) => {
    push(message);
    check();
  };
}

await chat.sendMessage({ text: config.text });
if (config.resume !== undefined) {
  await chat.resumeStream();
}

process.stdout.write(
  JSON.stringify({
    status: chat.status,
    error: chat.error?.message ?? null,
    messages: chat.messages,
    chunks,
    headers: postHeaders,
    finish,
    stopped,
  }),
);
