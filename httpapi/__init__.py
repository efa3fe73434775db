"""The OpenAI-compatible HTTP layer's protocol: what a route needs besides the engine.
(A top-level `http` package would shadow the standard library.)

    auth       check_api_key(authorization_header, api_key)                  401
    chat_request  parse_chat_completion (body bytes)                         400
    requests   parse_completion / parse_generate / parse_tokenize /
               parse_detokenize / parse_abort (body bytes)                   400
               (the fields they share: request_fields, grammar_fields)
    info       check_model(model, served_names) 404; served_model_names(model_path, names);
               /v1/models, /get_model_info, /get_server_info bodies
    sampling   req.sampling.resolve(prompt_ids, context_len, vocab_size)
               -> SamplingParams, after tokenizing                           400
    responses  choice_results(states) -> ChoiceResult, Usage ->
               chat.completion / text_completion / /generate bodies
    sse        ChatStream / CompletionStream / GenerateStream events, DONE,
               error_event, HEADERS
    logprobs   TokenLogprobs (numpy columns), LogprobVocab (id -> bytes, text)
    errors     APIError(status, message, param, type, code): .status, .body();
               engine_error(code, message): an ERROR record as an APIError

A route: check_api_key, parse, check_model, tokenize, resolve; on APIError answer
err.status with err.body() (content-type application/json), mid-stream send
error_event(err) then DONE. Anything else raised is a bug: answer
errors.internal_error() and log it.
"""
