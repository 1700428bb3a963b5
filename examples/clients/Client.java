// Java 17 through sluice, run as a single file: `java Client.java`.
// HttpURLConnection follows -Dhttp.proxyHost/-Dhttp.proxyPort (https.* for https://),
// but skips the proxy for -Dhttp.nonProxyHosts, which by default is
// localhost|127.*|[::1]: run.sh passes -Dhttp.nonProxyHosts= to send local targets too.
// java.net.http.HttpClient only uses them with .proxy(ProxySelector.getDefault()).
import java.net.HttpURLConnection;
import java.net.ProxySelector;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;

public class Client {
    public static void main(String[] args) throws Exception {
        String target = System.getenv().getOrDefault("TARGET", "http://127.0.0.1:9000/hello");
        HttpURLConnection c = (HttpURLConnection) URI.create(target).toURL().openConnection();
        c.setRequestProperty("X-Endpoint-Id", "demo");
        String scheme = target.startsWith("https:") ? "https" : "http";
        System.out.println("java HttpURLConnection (" + scheme + ".proxyHost="
                + System.getProperty(scheme + ".proxyHost", "unset") + ", http.nonProxyHosts="
                + System.getProperty("http.nonProxyHosts", "default") + "): " + c.getResponseCode());
        HttpClient client = HttpClient.newBuilder().proxy(ProxySelector.getDefault()).build();
        HttpRequest req = HttpRequest.newBuilder(URI.create(target)).header("X-Endpoint-Id", "demo").build();
        System.out.println("java HttpClient + ProxySelector.getDefault(): "
                + client.send(req, HttpResponse.BodyHandlers.discarding()).statusCode());
    }
}
